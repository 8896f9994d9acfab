"""The package imports, reports the version its metadata declares, and exports its API."""

from importlib.metadata import PackageNotFoundError, version

import pytest

import amp_legacy_fp16


def test_version_matches_distribution_metadata() -> None:
    try:
        declared = version("amp-legacy-fp16")
    except PackageNotFoundError:
        pytest.skip("amp-legacy-fp16 is not installed (run through `nox -s tests`)")
    assert amp_legacy_fp16.__version__ == declared


def test_exports_the_apex_names() -> None:
    for name in amp_legacy_fp16.__all__:
        assert hasattr(amp_legacy_fp16, name), name
    assert {"FP16_Optimizer", "LossScaler", "DynamicLossScaler", "amp"} <= set(
        amp_legacy_fp16.__all__
    )
