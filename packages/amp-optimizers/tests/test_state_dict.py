"""``state_dict`` / ``load_state_dict`` round trips are bitwise, for every registered optimizer.

A run that is saved, loaded into a fresh optimizer over a copy of its params and continued must
be indistinguishable from the uninterrupted run: same params and same state, bit for bit and
dtype for dtype (float32 state of half params stays float32).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from amp_test_support import DEVICES

from _amp_optimizers_helpers import (
    ACTIVE,
    GROUP_SHAPES,
    SPECS,
    OptimizerSpec,
    assert_bitwise_equal,
    make_params,
    run_steps,
    snapshot,
    two_groups,
)

MIXED = [torch.float32, torch.bfloat16, torch.float16, torch.float32] * 2
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(MIXED, id="mixed"),
]


def _copy_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _transfer(state_dict: dict[str, Any], via: str) -> dict[str, Any]:
    if via == "in_memory":
        return state_dict
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via", ["torch_save", "in_memory"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_resumed_run_equals_the_uninterrupted_one(
    spec: OptimizerSpec, dtype: Any, via: str, device: str
) -> None:
    params = make_params(device, dtype)
    opt = spec.factory(two_groups(params, spec.second_group))
    run_steps(opt, params, range(3))

    resumed = _copy_params(params)
    opt2 = spec.factory(two_groups(resumed, spec.second_group))
    opt2.load_state_dict(_transfer(opt.state_dict(), via))
    assert_bitwise_equal(snapshot(opt2, resumed), snapshot(opt, params))

    run_steps(opt, params, range(3, 6))
    run_steps(opt2, resumed, range(3, 6))
    assert_bitwise_equal(snapshot(opt2, resumed), snapshot(opt, params))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_round_trip_after_add_param_group(spec: OptimizerSpec, device: str) -> None:
    n = len(GROUP_SHAPES[0])
    first_group = [i for i in ACTIVE if i < n]

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return spec.factory([{"params": params[:n]}])

    params = make_params(device, MIXED)
    opt = build(params)
    run_steps(opt, params, range(2), active=first_group)
    opt.add_param_group({"params": params[n:], **spec.second_group})
    run_steps(opt, params, range(2, 4))
    assert all(params[i] in opt.state for i in ACTIVE)

    resumed = _copy_params(params)
    opt2 = build(resumed)
    opt2.add_param_group({"params": resumed[n:], **spec.second_group})
    opt2.load_state_dict(_transfer(opt.state_dict(), "torch_save"))
    run_steps(opt, params, range(4, 7))
    run_steps(opt2, resumed, range(4, 7))
    assert_bitwise_equal(snapshot(opt2, resumed), snapshot(opt, params))
