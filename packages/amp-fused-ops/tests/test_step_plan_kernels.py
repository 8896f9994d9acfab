"""The step-plan ops of the CUDA sources (csrc/common/step_plans.h under the CUDA backend).

``multi_tensor_plan_set`` stores a group's lists, ``multi_tensor_plan_gather`` reads the
gradients off the params, ``multi_tensor_adam_plan`` / ``multi_tensor_sgd_plan`` step a
bucket: the result must be the bits ``multi_tensor_adam`` / ``multi_tensor_sgd`` give the
same lists passed in the call. Runs on a GPU, or on the
emulated build (``AMP_FUSED_OPS_EMULATION``; see ``_kernel_target.py``). The CPU kernels'
plans are tested through FusedAdam (packages/amp-optimizers/tests/test_step_plan_lists.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, EMULATED, extension

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

BF16 = torch.bfloat16
# The params of one group: float32, bfloat16 (a second bucket), and one without a gradient.
DTYPES = (torch.float32, BF16, torch.float32, BF16, torch.float32)
FROZEN = 2


def _ops() -> Any:
    extension()
    return torch.ops.amp_fused_ops_emu if EMULATED else torch.ops.amp_fused_ops


def _group(seed: int, columns: int) -> tuple[list[Tensor], list[list[Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(37 * (i + 1), generator=gen).to(DEVICE, d) for i, d in enumerate(DTYPES)]
    for i, p in enumerate(params):
        if i != FROZEN:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype)
    moments = [
        [torch.rand(p.shape, generator=gen).to(DEVICE) for p in params if p.grad is not None]
        for _ in range(columns)
    ]
    return params, moments


# op -> (state lists, its scalar arguments at a step, the list op's arguments after the lists)
OPS: dict[str, tuple[int, Any, Any]] = {
    "adam": (
        2,
        lambda step: (1e-2, 0.9, 0.999, 1e-8, step, 1, 1, 0.05),
        lambda step: (1e-2, 0.9, 0.999, 1e-8, step, 1, 1, 0.05),
    ),
    "sgd": (
        1,
        lambda step: (0.05, 0.9, 0.0, 1e-2, True, False, False, 1.0),
        lambda step: (None, 0.05, 0.9, 0.0, 1e-2, True, False, False, 1.0),  # no model copies
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_plan_op_steps_the_bits_of_the_op_on_passed_lists(name: str) -> None:
    ops = _ops()
    columns, plan_scalars, list_scalars = OPS[name]
    plan_op = getattr(ops, f"multi_tensor_{name}_plan")
    list_op = getattr(ops, f"multi_tensor_{name}")
    planned, planned_moments = _group(0, columns)
    passed, passed_moments = _group(0, columns)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    buckets = [
        -1 if i == FROZEN else (0 if d == torch.float32 else 1) for i, d in enumerate(DTYPES)
    ]
    device_tensor = torch.empty(0, dtype=torch.int32, device=DEVICE)
    handle = 7001
    state = [m for column in planned_moments for m in column]
    ops.multi_tensor_plan_set(device_tensor, handle, planned, buckets, state, columns)
    try:
        for step in (1, 2):
            assert ops.multi_tensor_plan_gather(device_tensor, handle) is True
            for bucket in (0, 1):
                plan_op(2048, flag, handle, bucket, *plan_scalars(step))
            stepped = [i for i in range(len(DTYPES)) if i != FROZEN]
            params = [passed[i] for i in stepped]
            for dtype in (torch.float32, BF16):
                rows = [j for j, i in enumerate(stepped) if DTYPES[i] == dtype]
                list_op(
                    2048,
                    flag,
                    [params[j].grad for j in rows],
                    [params[j] for j in rows],
                    *([column[j] for j in rows] for column in passed_moments),
                    *list_scalars(step),
                )
        expected = passed + [m for column in passed_moments for m in column]
        actual = planned + [m for column in planned_moments for m in column]
        for a, b in zip(actual, expected, strict=True):
            assert torch.equal(a, b)
        # A param that gains a gradient, or changes dtype, no longer matches the plan.
        planned[FROZEN].grad = torch.ones_like(planned[FROZEN])
        assert ops.multi_tensor_plan_gather(device_tensor, handle) is False
        planned[FROZEN].grad = None
        planned[0].data = planned[0].data.to(BF16)
        assert ops.multi_tensor_plan_gather(device_tensor, handle) is False
        with pytest.raises(ValueError, match="holds no gradients"):
            plan_op(2048, flag, handle, 0, *plan_scalars(3))
    finally:
        ops.multi_tensor_plan_drop(device_tensor, handle)
    assert ops.multi_tensor_plan_gather(device_tensor, handle) is False
