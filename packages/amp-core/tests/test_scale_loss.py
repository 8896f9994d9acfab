"""amp.scale_loss: unscaling on exit, gradient accumulation, clipping, several optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, DEVICES, HALF_DTYPES

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp

OPT_LEVELS = ["O1", "O2"]


def _init(opt_level, half, device="cpu", lr=0.1, seed=0):
    model = tiny_mlp(seed).to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=lr)


def _no_skips(opt):
    assert amp.skipped_steps(opt) == 0, "an unexpected overflow skipped a step"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_grads_unscaled_on_exit(device, half, opt_level):
    model, opt, ref, _ = _init(opt_level, half, device)
    x, y = batch(0, device=device)
    F.mse_loss(ref(x), y).backward()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    for m, r in zip(masters, ref.parameters(), strict=True):
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, r.grad, **CHAIN_TOL[half])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("delay_first", [True, False], ids=["delay_unscale", "no_delay"])
def test_gradient_accumulation_equals_one_big_batch(device, half, opt_level, delay_first):
    model, opt, ref, ref_opt = _init(opt_level, half, device)
    x, y = batch(0, n=8, device=device)
    halves = [(x[:4], y[:4]), (x[4:], y[4:])]

    # Reference: one fp32 step on the summed loss of the whole batch.
    ref_loss = sum(F.mse_loss(ref(xb), yb) for xb, yb in halves)
    ref_loss.backward()
    ref_opt.step()

    opt.zero_grad()
    for i, (xb, yb) in enumerate(halves):
        loss = F.mse_loss(model(xb), yb)
        with amp.scale_loss(loss, opt, delay_unscale=delay_first and i == 0) as scaled:
            scaled.backward()
    opt.step()
    _no_skips(opt)

    for m, r in zip(amp.master_params(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(m.detach().float(), r.detach(), **CHAIN_TOL[half])
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().float(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_accumulated_grads_equal_sum_of_micro_batch_grads(half, opt_level):
    """Accumulating two micro-batches gives the sum of their single-batch grads (fp32 ref)."""
    model, opt, ref, _ = _init(opt_level, half)
    x, y = batch(1, n=8)
    F.mse_loss(ref(x[:4]), y[:4]).backward()
    F.mse_loss(ref(x[4:]), y[4:]).backward()
    opt.zero_grad()
    for sl in (slice(0, 4), slice(4, 8)):
        with amp.scale_loss(F.mse_loss(model(x[sl]), y[sl]), opt) as scaled:
            scaled.backward()
    for m, r in zip(amp.master_params(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(m.grad.float(), r.grad, **CHAIN_TOL[half])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_clip_grad_norm_on_master_params(device, half, opt_level):
    model, opt, ref, ref_opt = _init(opt_level, half, device)
    x, y = batch(2, device=device)
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.05)
    ref_opt.step()

    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.05)
    assert ref_norm > 0.05, "test needs clipping to be active"
    torch.testing.assert_close(norm.float(), ref_norm, **CHAIN_TOL[half])
    opt.step()
    _no_skips(opt)
    for m, r in zip(amp.master_params(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(m.detach().float(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_list_of_optimizers(half, opt_level):
    model = tiny_mlp()
    ref = copy.deepcopy(model)
    o_first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o_last = torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.5)
    model, (o_first, o_last) = amp.initialize(
        model, [o_first, o_last], opt_level=opt_level, half_dtype=half, verbosity=0
    )
    r_first = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    r_last = torch.optim.SGD(ref[2].parameters(), lr=0.05, momentum=0.5)
    for seed in range(2):
        x, y = batch(seed)
        for o in (o_first, o_last, r_first, r_last):
            o.zero_grad()
        F.mse_loss(ref(x), y).backward()
        r_first.step()
        r_last.step()
        with amp.scale_loss(F.mse_loss(model(x), y), [o_first, o_last]) as scaled:
            scaled.backward()
        o_first.step()
        o_last.step()
    masters = list(amp.master_params(o_first)) + list(amp.master_params(o_last))
    assert len(masters) == 4
    for m, r in zip(masters, ref.parameters(), strict=True):
        torch.testing.assert_close(m.detach().float(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_zero_grad_clears_master_grads(half):
    model, opt, _, _ = _init("O2", half)
    x, y = batch(0)
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.zero_grad()
    for m in amp.master_params(opt):
        assert m.grad is None or not m.grad.any()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    first = [m.grad.clone() for m in amp.master_params(opt)]
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    for m, f in zip(amp.master_params(opt), first, strict=True):
        torch.testing.assert_close(m.grad, f, rtol=0, atol=0)  # no leftover accumulation


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_scale_loss_with_model_argument_and_delay_overflow_check(half):
    model, opt, ref, ref_opt = _init("O1", half)
    x, y = batch(3)
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(
        loss, opt, loss_id=0, model=model, delay_unscale=False, delay_overflow_check=False
    ) as scaled:
        scaled.backward()
    opt.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_parity_with_o0(half, opt_level):
    """A tiny regression run ends close to O0.

    The bound is loose on purpose: 60 SGD steps compound per-step rounding (fp16 ~1e-3,
    bf16 ~8e-3 relative per op) along the trajectory, so the final loss is compared with
    a relative bound (5% fp16, 15% bf16), and both must have learnt (loss fell 5x).
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    w_true = torch.randn(6, 2, generator=g)
    y = torch.tanh(x @ w_true)

    def run(level):
        model = tiny_mlp(3, din=6, dhid=16, dout=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        kw = {} if level == "O0" else {"half_dtype": half}
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
        first = None
        for _ in range(60):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            first = float(loss.detach()) if first is None else first
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        with torch.no_grad():
            final = float(F.mse_loss(model(x).float(), y))
        return first, final

    first0, final0 = run("O0")
    first, final = run(opt_level)
    assert final0 < first0 / 5 and final < first / 5
    rel = {torch.float16: 0.05, torch.bfloat16: 0.15}[half]
    assert abs(final - final0) <= rel * final0 + 1e-3, (final, final0)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_master_params_are_the_fp32_model_params(half):
    model, opt, _, _ = _init("O1", half)
    masters = list(amp.master_params(opt))
    assert [id(m) for m in masters] == [id(p) for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
