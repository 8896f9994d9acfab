"""Every fused optimizer survives ``copy.deepcopy`` and pickling (``torch.save(optimizer)``).

A fused optimizer keeps options as attributes (Apex's ``adam_w_mode``, ``capturable``, ...),
which ``torch.optim.Optimizer.__getstate__`` alone would drop: the copy's first step raised
AttributeError. The copy must step exactly as the original, on its own tensors, and the two
must not share step plans (which hold the compiled kernels' handles of their lists).
"""

from __future__ import annotations

import copy
import gc
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _amp_optimizers_helpers import assert_bitwise_equal, loss_of, make_params, two_groups
from amp_optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

BF16 = torch.bfloat16
MIXED = [torch.float32, BF16, torch.float32, torch.float32, BF16, torch.float32, BF16, BF16]

# name -> (param dtypes, the optimizer of two groups)
OPTIMIZERS: dict[str, tuple[Any, Callable[[list[dict[str, Any]]], Any]]] = {
    "adam": (torch.float32, lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    "adam-capturable": (torch.float32, lambda g: FusedAdam(g, lr=1e-2, capturable=True)),
    "adam-master-weights": (MIXED, lambda g: FusedAdam(g, lr=1e-2, master_weights=True)),
    "sgd": (
        torch.float32,
        lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, wd_after_momentum=True),
    ),
    "lamb": (torch.float32, lambda g: FusedLAMB(g, lr=1e-2, use_nvlamb=True)),
    "novograd": (torch.float32, lambda g: FusedNovoGrad(g, lr=1e-2, reg_inside_moment=True)),
    "adagrad": (torch.float32, lambda g: FusedAdagrad(g, lr=1e-2, adagrad_w_mode=True)),
    "mixed-precision-lamb": (
        MIXED,
        lambda g: FusedMixedPrecisionLamb(g, lr=1e-2, reduced_precision_dtype=BF16),
    ),
}


def _deepcopy(optimizer: Any) -> Any:
    return copy.deepcopy(optimizer)


def _pickled(optimizer: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(optimizer, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _deepcopy, "torch.save": _pickled}


def _params_of(optimizer: Any) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step(optimizer: Any, number: int) -> None:
    params = _params_of(optimizer)
    optimizer.zero_grad()
    loss_of(params, number).backward()
    optimizer.step()


def _values(optimizer: Any) -> list[object]:
    params = _params_of(optimizer)
    return [[p.detach() for p in params], [dict(optimizer.state.get(p, {})) for p in params]]


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_copy_steps_as_the_original(name: str, how: str) -> None:
    dtypes, make = OPTIMIZERS[name]
    original = make(two_groups(make_params(dtype=dtypes), {"weight_decay": 0.0}))
    for number in range(2):
        _step(original, number)
    duplicate = COPIES[how](original)
    assert type(duplicate) is type(original)
    # Its own tensors: no param of the copy is a param of the original.
    originals = {id(p) for p in _params_of(original)}
    assert not any(id(p) in originals for p in _params_of(duplicate))
    assert duplicate._plans == {}  # built afresh at its first step
    for number in range(2, 5):
        _step(duplicate, number)
        _step(original, number)
        assert_bitwise_equal(_values(duplicate), _values(original))
    # The copy gone, the original's plans (and the lists its kernels hold) are intact.
    del duplicate
    gc.collect()
    reference = make(two_groups(make_params(dtype=dtypes), {"weight_decay": 0.0}))
    for number in range(6):
        _step(reference, number)
    _step(original, 5)
    assert_bitwise_equal(_values(original), _values(reference))


def test_a_copy_keeps_the_options_set_as_attributes() -> None:
    params = make_params()
    original = FusedSGD(two_groups(params, {}), lr=1e-2, momentum=0.9, wd_after_momentum=True)
    original.set_grad_none = False
    duplicate = copy.deepcopy(original)
    assert duplicate.wd_after_momentum is True and duplicate.set_grad_none is False
    assert duplicate._dummy_overflow_buf is duplicate.noop_flag(torch.device("cpu"))
