"""The legacy entry points warn with DeprecatedFeatureWarning, as Apex's did."""

from __future__ import annotations

import warnings

import pytest
import torch

import amp_legacy_fp16
from amp_legacy_fp16 import (
    DeprecatedFeatureWarning,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
)


def _sgd() -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    return torch.optim.SGD(model.parameters(), lr=0.1)


ENTRY_POINTS = {
    "FP16_Optimizer": lambda: FP16_Optimizer(_sgd()),
    "FP16Model": lambda: FP16Model(torch.nn.Linear(2, 2)),
    "LossScaler": lambda: LossScaler(),
    "DynamicLossScaler": lambda: DynamicLossScaler(),
    "amp.init": lambda: amp_legacy_fp16.amp.init(enabled=True),
}


def test_is_a_future_warning_exported_at_the_top():
    assert issubclass(DeprecatedFeatureWarning, FutureWarning)
    assert "DeprecatedFeatureWarning" in amp_legacy_fp16.__all__


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_point_warns_with_deprecated_feature_warning(name):
    with pytest.warns(DeprecatedFeatureWarning, match="deprecated"):
        ENTRY_POINTS[name]()


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_filtering_the_class_silences_the_entry_point(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=DeprecatedFeatureWarning)
        ENTRY_POINTS[name]()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
