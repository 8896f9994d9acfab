"""FusedAdam's device path: ``capturable=True``, ``master_weights=True`` and its skip logic.

On the device path ``lr``, the step count, the inverse scale and the skip flag are tensors;
each launch checks its gradients before writing, and an inf or a nan anywhere (any dtype
bucket, any group) skips the whole step.
"""

from __future__ import annotations

import io

import pytest
import torch
from amp_test_support import DEVICES, HALF_DTYPES

from _amp_optimizers_helpers import (
    ACTIVE,
    FP32_ATOL,
    GROUP_SHAPES,
    assert_bitwise_equal,
    float_copies,
    loss_of,
    make_params,
    max_abs_diff,
    run_steps,
    snapshot,
    two_groups,
)
from amp_optimizers import FusedAdam

SECOND = dict(lr=5e-3, betas=(0.9, 0.95), weight_decay=0.05)
MIXED = [torch.float32, torch.bfloat16, torch.float16, torch.float32] * 2


def _adam(params: list[torch.Tensor], **kwargs: object) -> FusedAdam:
    return FusedAdam(two_groups(params, SECOND), lr=2e-2, weight_decay=0.1, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_capturable_equals_the_plain_path(device: str) -> None:
    params = make_params(device)
    plain_params = make_params(device)
    opt = _adam(params, capturable=True)
    plain = _adam(plain_params)

    for group in opt.param_groups:
        assert isinstance(group["lr"], torch.Tensor)
        assert group["lr"].device == group["params"][0].device
    run_steps(opt, params, range(10))
    run_steps(plain, plain_params, range(10))

    assert max_abs_diff(params, plain_params) <= FP32_ATOL
    for group in opt.param_groups:
        assert isinstance(group["step"], torch.Tensor) and group["step"].item() == 10
    assert [g["step"] for g in plain.param_groups] == [10, 10]


def test_capturable_group_added_later_gets_a_tensor_lr() -> None:
    params = make_params()
    n = len(GROUP_SHAPES[0])
    opt = FusedAdam([{"params": params[:n]}], lr=1e-2, capturable=True)
    opt.add_param_group({"params": params[n:], "lr": 5e-3})
    lr = opt.param_groups[1]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(5e-3)


def test_capturable_round_trip_is_bitwise() -> None:
    params = make_params()
    opt = _adam(params, capturable=True)
    run_steps(opt, params, range(3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _adam(resumed, capturable=True)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt2.param_groups)
    run_steps(opt, params, range(3, 6))
    run_steps(opt2, resumed, range(3, 6))
    assert_bitwise_equal(snapshot(opt2, resumed), snapshot(opt, params))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_master_weights_step_float32_masters(dtype: torch.dtype, device: str) -> None:
    # The masters follow torch's AdamW on float32 copies fed the same (half) gradients, and
    # the half params are the masters rounded.
    params = make_params(device, dtype)
    ref_params = float_copies(params)
    opt = _adam(params, master_weights=True)
    ref = torch.optim.AdamW(two_groups(ref_params, SECOND), lr=2e-2, weight_decay=0.1)
    for step in range(10):
        for o, ps in ((opt, params), (ref, ref_params)):
            o.zero_grad()
            loss_of(ps, step).backward()
        for p, r in zip(params, ref_params, strict=True):
            if p.grad is not None:
                assert r.grad is not None
                r.grad.copy_(p.grad)
        opt.step()
        ref.step()

    for i in ACTIVE:
        master = opt.state[params[i]]["master_param"]
        assert master.dtype == torch.float32
        assert max_abs_diff([master], [ref_params[i]]) <= FP32_ATOL
        assert torch.equal(params[i], master.to(dtype))


def test_master_weights_round_trip_is_bitwise() -> None:
    params = make_params(dtype=MIXED)
    opt = _adam(params, master_weights=True)
    run_steps(opt, params, range(3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _adam(resumed, master_weights=True)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    run_steps(opt, params, range(3, 6))
    run_steps(opt2, resumed, range(3, 6))
    assert_bitwise_equal(snapshot(opt2, resumed), snapshot(opt, params))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ACTIVE, ids=lambda i: f"inf_in_param{i}")
def test_an_inf_anywhere_skips_every_bucket_and_group(bad: int, device: str) -> None:
    # Float32, bf16 and fp16 buckets in both groups: whichever gradient holds the inf, nothing
    # is written and no step count advances.
    params = make_params(device, MIXED)
    opt = _adam(params, master_weights=True)
    run_steps(opt, params, range(2))
    before = snapshot(opt, params)

    opt.zero_grad()
    loss_of(params, 2).backward()
    grad = params[bad].grad
    assert grad is not None
    grad.view(-1)[-1] = float("nan") if bad % 2 else float("inf")
    opt.step()

    assert_bitwise_equal(snapshot(opt, params), before)
    run_steps(opt, params, range(3, 4))  # the next finite step is taken
    assert [g["step"].item() for g in opt.param_groups] == [3, 3]


def test_step_count_is_per_group_as_in_apex() -> None:
    # Apex keeps one step count per group: a param that joins late is bias-corrected with the
    # group's count (torch.optim.Adam would count its own steps).
    params = make_params()
    opt = _adam(params)
    run_steps(opt, params, range(3), active=[0, 2])
    run_steps(opt, params, range(3, 4))
    assert [g["step"] for g in opt.param_groups] == [4, 1]
