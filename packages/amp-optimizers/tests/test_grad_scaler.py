"""``torch.amp.GradScaler`` with every registered optimizer (device "cpu" works on CPU).

FusedAdam declares ``_step_supports_amp_scaling``: the scaler hands it ``grad_scale`` and
``found_inf`` and the optimizer unscales inside its step, leaving the gradients scaled. The
others get torch's default treatment: the scaler unscales the gradients in place, checks them
and skips ``step()`` on inf/nan. Either way an overflow leaves params and state untouched and
halves the scale, and a step without overflow equals the unscaled one.
"""

from __future__ import annotations

import pytest
import torch

from _registry import (
    ACTIVE,
    DEVICES,
    SPECS,
    OptimizerSpec,
    assert_bitwise_equal,
    loss_of,
    make_params,
    max_abs_diff,
    run_steps,
    snapshot,
    two_groups,
)
from amp_optimizers import FusedAdam

INIT_SCALE = 2.0**10


def _scaled_steps(
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    scaler: torch.amp.GradScaler,
    steps: range,
) -> None:
    for step in steps:
        opt.zero_grad()
        scaler.scale(loss_of(params, step)).backward()
        scaler.step(opt)
        scaler.update()


def _supports_amp_scaling(spec: OptimizerSpec) -> bool:
    return bool(getattr(spec.fused, "_step_supports_amp_scaling", False))


def test_which_optimizers_unscale_inside_their_step() -> None:
    supporting = {s.fused.__name__ for s in SPECS if _supports_amp_scaling(s)}
    assert supporting == {"FusedAdam"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_scaled_steps_equal_unscaled_steps(spec: OptimizerSpec, device: str) -> None:
    params = make_params(device)
    plain_params = make_params(device)
    opt = spec.factory(two_groups(params, spec.second_group))
    plain = spec.factory(two_groups(plain_params, spec.second_group))
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)

    _scaled_steps(opt, params, scaler, range(4))
    run_steps(plain, plain_params, range(4))

    assert scaler.get_scale() == INIT_SCALE
    assert max_abs_diff(params, plain_params) <= spec.atol
    # The gradients the last step read: FusedAdam leaves them scaled, the scaler unscales the
    # others' in place.
    factor = INIT_SCALE if _supports_amp_scaling(spec) else 1.0
    for i in ACTIVE:
        grad, plain_grad = params[i].grad, plain_params[i].grad
        assert grad is not None and plain_grad is not None
        torch.testing.assert_close(grad, plain_grad * factor, rtol=1e-5, atol=1e-5 * factor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_an_inf_gradient_skips_the_step_and_halves_the_scale(
    spec: OptimizerSpec, device: str
) -> None:
    params = make_params(device)
    opt = spec.factory(two_groups(params, spec.second_group))
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    _scaled_steps(opt, params, scaler, range(2))
    before = snapshot(opt, params)

    opt.zero_grad()
    scaler.scale(loss_of(params, 2)).backward()
    grad = params[ACTIVE[-1]].grad
    assert grad is not None
    grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()

    assert_bitwise_equal(snapshot(opt, params), before)
    assert scaler.get_scale() == INIT_SCALE / 2
    _scaled_steps(opt, params, scaler, range(3, 4))  # and training goes on
    assert max_abs_diff(params, before["params"]) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_fp16_params(spec: OptimizerSpec, device: str) -> None:
    params = make_params(device, torch.float16)
    opt = spec.factory(two_groups(params, spec.second_group))
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    if not _supports_amp_scaling(spec):
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            _scaled_steps(opt, params, scaler, range(1))
        return
    plain_params = make_params(device, torch.float16)
    plain = spec.factory(two_groups(plain_params, spec.second_group))
    _scaled_steps(opt, params, scaler, range(3))
    run_steps(plain, plain_params, range(3))
    scale = max(p.abs().max().item() for p in plain_params)
    # The two launch paths may round the last bit differently.
    assert max_abs_diff(params, plain_params) <= torch.finfo(torch.float16).eps * scale
    assert scaler.get_scale() == INIT_SCALE


def test_fused_adam_reads_the_scale_on_the_device() -> None:
    # With found_inf set by the scaler, FusedAdam skips on the device: the step count of the
    # group is a tensor that did not advance.
    params = make_params()
    opt = FusedAdam(two_groups(params, {}), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    _scaled_steps(opt, params, scaler, range(2))
    steps = [g["step"] for g in opt.param_groups]
    assert all(isinstance(s, torch.Tensor) and s.item() == 2 for s in steps)
    opt.zero_grad()
    scaler.scale(loss_of(params, 2) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert [g["step"].item() for g in opt.param_groups] == [2, 2]
