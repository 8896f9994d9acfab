"""The stage of an amp optimizer's step: calls out of order are refused with the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp
from amp_core._optimizer import Stage, optimizer_state


def _init(opt_level: str, **kwargs):
    model = tiny_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0, **kwargs
    )


def _backward(model, opt, **kwargs) -> None:
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt, **kwargs) as scaled:
        scaled.backward()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_step_after_a_delayed_unscale_names_the_fix(opt_level):
    model, opt = _init(opt_level, loss_scale=128.0)
    _backward(model, opt, delay_unscale=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"delay_unscale=True.*delay_unscale=False"):
        opt.step()
    # Nothing was stepped with the scaled gradients.
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_the_named_fixes_recover(opt_level):
    model, opt = _init(opt_level, loss_scale=128.0)
    # Fix 1: drop the scaled gradients, then a normal step.
    _backward(model, opt, delay_unscale=True)
    opt.zero_grad()
    _backward(model, opt)
    opt.step()
    # Fix 2: the last scale_loss of the step does not delay.
    _backward(model, opt, delay_unscale=True)
    _backward(model, opt)
    opt.step()
    assert amp.skipped_steps(opt) == 0


def test_stages_of_an_ordinary_step():
    model, opt = _init("O2", loss_scale=128.0)
    state = optimizer_state(opt)
    assert state is not None and state.stage is Stage.READY
    _backward(model, opt, delay_unscale=True)
    assert state.stage is Stage.ACCUMULATING and state.grads_scaled
    _backward(model, opt)
    assert state.stage is Stage.UNSCALED and not state.grads_scaled
    opt.step()
    assert state.stage is Stage.READY


def test_scale_loss_after_remove_names_the_fix():
    model, opt = _init("O2")
    state = optimizer_state(opt)
    assert state is not None
    x, y = batch(0)
    loss = F.mse_loss(model(x).float(), y)
    state.remove()  # the model params go back into the groups as fp32
    assert state.stage is Stage.CLOSED
    with (
        pytest.raises(RuntimeError, match=r"amp wrapping was removed.*latest amp\.initialize"),
        amp.scale_loss(loss, opt),
    ):
        pass


def test_closure_on_an_overflowed_step_names_the_fix():
    model, opt = _init("O2", loss_scale="dynamic")
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        (scaled * float("inf")).backward()
    with pytest.raises(RuntimeError, match=r"closure.*optimizer\.step\(\) without a closure"):
        opt.step(lambda: None)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_stages_around_a_failed_block(opt_level):
    model, opt = _init(opt_level, loss_scale=128.0)
    state = optimizer_state(opt)
    assert state is not None
    _backward(model, opt, delay_unscale=True)
    before = state.stage
    x, y = batch(1)
    with pytest.raises(KeyError), amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        assert state.stage is Stage.BACKWARD
        scaled.backward()
        opt.zero_grad()  # drops the held gradients: an exception now leaves none
        assert state.stage is Stage.BACKWARD
        raise KeyError("bad batch")
    assert before is Stage.ACCUMULATING
    assert state.stage is Stage.READY
    assert all(p.grad is None for p in amp.master_params(opt))
