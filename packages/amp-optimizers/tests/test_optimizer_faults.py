"""Misuse that must not corrupt training: a param group added to FusedAdam after amp O2, a
loss scale of inf, and checkpoints with impossible values (refused whole, never half-loaded)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from amp_core import amp
from amp_optimizers import FP16_Optimizer, FusedAdam

ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)


def test_o2_fused_adam_param_group_added_after_initialize_gets_masters_and_unscaled_grads():
    """The group gets float32 masters in FusedAdam's state and steps as the first group."""
    model = _model()
    ref = _model()
    opt = FusedAdam(model[0].parameters(), **ADAM)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters())})
    ref_opt = torch.optim.Adam(ref[0].parameters(), **ADAM)
    ref_opt.add_param_group({"params": list(ref[2].parameters())})
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert all("master_param" in opt.state[p] for p in model[2].parameters())

    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    for got, want in zip(list(amp.master_params(opt))[2:], ref[2].parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -2.0])
def test_loss_scale_setter_refuses_what_no_scale_can_be(value: float) -> None:
    opt = FP16_Optimizer(FusedAdam(_model(torch.float16).parameters()), dynamic_loss_scale=True)
    with pytest.raises(ValueError, match="loss scale must be positive and finite"):
        opt.loss_scale = value
    assert opt.loss_scale == 2.0**16


def test_load_state_dict_with_a_bad_scale_loads_nothing() -> None:
    model = _model(torch.float16)
    opt = FP16_Optimizer(FusedAdam(model.parameters()), dynamic_loss_scale=True, verbose=False)
    saved = opt.state_dict()
    saved = {**saved, "cur_iter": 7, "last_overflow_iter": 3, "cur_scale": 0.0}
    with pytest.raises(ValueError, match="cur_scale"):
        opt.load_state_dict(saved)
    assert (opt.cur_iter, opt.last_overflow_iter, opt.loss_scale) == (0, -1, 2.0**16)


def test_load_state_dict_refuses_masters_holding_nan() -> None:
    model = _model(torch.float16)
    opt = FP16_Optimizer(FusedAdam(model.parameters()), dynamic_loss_scale=True, verbose=False)
    saved = opt.state_dict()
    bad = [m.clone() for m in saved["fp32_groups_flat"]]
    bad[0][0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="fp32_groups_flat"):
        opt.load_state_dict({**saved, "fp32_groups_flat": bad})
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
