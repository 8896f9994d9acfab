"""Checkpointing: model, optimizer and amp state dicts resume training bitwise."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import DEVICES, HALF_DTYPES

from _amp_core_helpers import batch, tiny_bn_net
from amp_core import amp

N_FIRST, N_TOTAL = 3, 6


def _build(opt_level, half, device, seed):
    model = tiny_bn_net(seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)


def _train(model, opt, steps, device, overflow_at):
    for s in steps:
        opt.zero_grad()
        x, y = batch(s, device=device)
        loss = F.mse_loss(model(x).float(), y)
        if s == overflow_at:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def _capture(model, opt):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in amp.master_params(opt)],
        {k: dict(v) for k, v in amp.state_dict().items()},
    )


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True by default: checkpoints must be plain data


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_resume_is_bitwise_identical(device, half, opt_level):
    dynamic = half == torch.float16 and opt_level in ("O1", "O2")
    overflow_at = 1 if dynamic else None  # a skipped step before the checkpoint moves the scaler

    # Uninterrupted run.
    model, opt = _build(opt_level, half, device, seed=0)
    _train(model, opt, range(N_TOTAL), device, overflow_at)
    expected = _capture(model, opt)
    if dynamic:
        assert amp.skipped_steps(opt) == 1

    # Interrupted run: N_FIRST steps, checkpoint.
    model, opt = _build(opt_level, half, device, seed=0)
    _train(model, opt, range(N_FIRST), device, overflow_at)
    ckpt = _round_trip(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
    )
    del model, opt

    # Fresh fp32 model and optimizer (different initial weights), initialize, load all three.
    model, opt = _build(opt_level, half, device, seed=123)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    _train(model, opt, range(N_FIRST, N_TOTAL), device, overflow_at)
    got = _capture(model, opt)

    sd_exp, params_exp, masters_exp, amp_exp = expected
    sd_got, params_got, masters_got, amp_got = got
    assert sd_got.keys() == sd_exp.keys()
    for k in sd_exp:
        assert sd_got[k].dtype == sd_exp[k].dtype, k
        assert torch.equal(sd_got[k], sd_exp[k]), f"state_dict[{k!r}] differs after resume"
    for a, b in zip(params_got, params_exp, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(masters_got, masters_exp, strict=True):
        assert torch.equal(a, b)
    assert amp_got == amp_exp


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_state_dict_survives_save_load(half, opt_level):
    _build(opt_level, half, "cpu", seed=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 5}})
    restored = _round_trip(amp.state_dict())
    _build(opt_level, half, "cpu", seed=1)  # a fresh session, as after a restart
    amp.load_state_dict(restored)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 5}}


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_optimizer_state_is_keyed_by_masters(half):
    """Momentum buffers live on fp32 masters, so they are fp32 in the checkpoint."""
    model, opt = _build("O2", half, "cpu", seed=0)
    _train(model, opt, range(2), "cpu", None)
    state = opt.state_dict()["state"]
    assert len(state) == len(list(model.parameters()))
    for entry in state.values():
        assert entry["momentum_buffer"].dtype == torch.float32
