"""``torch.amp.GradScaler`` with every registered optimizer (device "cpu" works on CPU).

FusedAdam with ``capturable=True`` or ``master_weights=True`` declares
``_step_supports_amp_scaling`` (Apex: only when capturable): the scaler hands it ``grad_scale``
and ``found_inf``, the optimizer unscales inside its step and writes the unscaled gradients
back. The others (and FusedAdam by default) get torch's default treatment: the scaler unscales
the gradients in place, checks them and skips ``step()`` on inf/nan. Either way an overflow
leaves params and state untouched and halves the scale, a step without overflow equals the
unscaled one, and ``.grad`` holds unscaled gradients after the step.
"""

from __future__ import annotations

import pytest
import torch
from amp_test_support import DEVICES

from _amp_optimizers_helpers import (
    ACTIVE,
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
    opt = spec.factory(two_groups(make_params(), spec.second_group))
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def test_which_optimizers_unscale_inside_their_step() -> None:
    supporting = {s.fused.__name__ for s in SPECS if _supports_amp_scaling(s)}
    assert supporting == set()  # built with their defaults: the scaler unscales
    params = make_params()
    assert FusedAdam(params, capturable=True)._step_supports_amp_scaling
    assert FusedAdam(params, master_weights=True)._step_supports_amp_scaling
    assert not FusedAdam(params)._step_supports_amp_scaling


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
    # The gradients the last step read are unscaled after it, as for torch's optimizers.
    for i in ACTIVE:
        grad, plain_grad = params[i].grad, plain_params[i].grad
        assert grad is not None and plain_grad is not None
        torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-5)


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
    # With found_inf set by the scaler, capturable FusedAdam skips on the device: the step
    # count of the group is a tensor that did not advance.
    params = make_params()
    opt = FusedAdam(two_groups(params, {}), lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    _scaled_steps(opt, params, scaler, range(2))
    steps = [g["step"] for g in opt.param_groups]
    assert all(isinstance(s, torch.Tensor) and s.item() == 2 for s in steps)
    opt.zero_grad()
    scaler.scale(loss_of(params, 2) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert [g["step"].item() for g in opt.param_groups] == [2, 2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "capturable", "master_weights"])
def test_fused_adam_grads_are_unscaled_after_the_step(device: str, mode: str) -> None:
    kwargs = {} if mode == "default" else {mode: True}
    params = make_params(device)
    plain_params = make_params(device)
    opt = FusedAdam(two_groups(params, {}), lr=1e-2, **kwargs)
    plain = FusedAdam(two_groups(plain_params, {}), lr=1e-2, **kwargs)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    _scaled_steps(opt, params, scaler, range(3))
    run_steps(plain, plain_params, range(3))
    assert max_abs_diff(params, plain_params) <= 1e-6
    for i in ACTIVE:
        torch.testing.assert_close(params[i].grad, plain_params[i].grad, rtol=1e-6, atol=1e-7)
    # An overflowing step: skipped, and the grads are still divided by the scale it used.
    opt.zero_grad()
    scaler.scale(loss_of(params, 3)).backward()
    scaled = [params[i].grad.clone() for i in ACTIVE]
    params[ACTIVE[0]].grad.view(-1)[0] = float("nan")
    scaler.step(opt)
    for i, before in zip(ACTIVE[1:], scaled[1:], strict=True):
        torch.testing.assert_close(params[i].grad, before / INIT_SCALE, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["capturable", "master_weights"])
def test_fused_adam_fp16_params_with_the_step_unscaling(mode: str) -> None:
    params = make_params("cpu", torch.float16)
    plain_params = make_params("cpu", torch.float16)
    opt = FusedAdam(two_groups(params, {}), lr=1e-2, **{mode: True})
    plain = FusedAdam(two_groups(plain_params, {}), lr=1e-2, **{mode: True})
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    _scaled_steps(opt, params, scaler, range(3))
    run_steps(plain, plain_params, range(3))
    scale = max(p.abs().max().item() for p in plain_params)
    assert max_abs_diff(params, plain_params) <= torch.finfo(torch.float16).eps * scale
    for i in ACTIVE:  # unscaled in fp16: one rounding of the division
        torch.testing.assert_close(params[i].grad, plain_params[i].grad, rtol=1e-3, atol=1e-5)
