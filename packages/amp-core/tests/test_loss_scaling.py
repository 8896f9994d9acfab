"""The loss scaler: Apex's dynamic policy, static scales, overflow skips, state_dict."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, DEVICES, HALF_DTYPES

from _amp_core_helpers import amp_log_records, batch, tiny_mlp
from amp_core import amp

OVERFLOW_MSG = re.compile(
    r"Gradient overflow\.\s+Skipping step, loss scaler 0 reducing loss scale to 32768\.0"
)


def _dynamic(opt_level, half, device="cpu", verbosity=0, **kw):
    """fp16 is dynamic by default; bf16 only when asked, so ask for it explicitly."""
    if half == torch.bfloat16:
        kw.setdefault("loss_scale", "dynamic")
    model = tiny_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=half, verbosity=verbosity, **kw
    )


def _scaler(idx=0):
    entry = amp.state_dict()[f"loss_scaler{idx}"]
    return float(entry["loss_scale"]), int(entry["unskipped"])


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [
        m.detach().clone() for m in amp.master_params(opt)
    ]


def _clean_step(model, opt, seed=0, device="cpu", loss_id=0):
    opt.zero_grad()
    x, y = batch(seed, device=device)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def _overflow_step(model, opt, inject, device="cpu"):
    opt.zero_grad()
    x, y = batch(9, device=device)
    handle = None
    if inject == "grad_inf":
        handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    elif inject == "grad_nan":
        handle = model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
    loss = F.mse_loss(model(x), y)
    if inject == "loss_inf":
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    if handle is not None:
        handle.remove()


# ---------------------------------------------------------------- initial state, yield


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_initial_state_and_scaled_loss(device, half, opt_level):
    model, opt = _dynamic(opt_level, half, device)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}
    x, y = batch(0, device=device)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(
            scaled.detach().reshape(loss.shape), loss.detach() * 65536.0, rtol=0, atol=0
        )
        scaled.backward()
    opt.step()
    assert _scaler() == (65536.0, 1)
    assert amp.skipped_steps(opt) == 0


# ---------------------------------------------------------------- overflow


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("inject", ["loss_inf", "grad_inf", "grad_nan"])
def test_overflow_skips_step_and_halves_scale(device, half, opt_level, inject, caplog):
    caplog.set_level(logging.DEBUG)
    model, opt = _dynamic(opt_level, half, device, verbosity=1)
    _clean_step(
        model, opt, device=device
    )  # momentum buffers exist: a non-skipped step would move params
    before = _snapshot(model, opt)
    state_before = {
        k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
        for k, v in opt.state_dict()["state"].items()
    }
    caplog.clear()

    _overflow_step(model, opt, inject, device)

    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), (
        "a skipped step changed parameters"
    )
    for k, v in opt.state_dict()["state"].items():
        for kk, vv in v.items():
            if torch.is_tensor(vv):
                assert torch.equal(vv, state_before[k][kk]), (
                    "a skipped step changed optimizer state"
                )
    assert _scaler() == (32768.0, 0)
    assert amp.skipped_steps(opt) == 1
    messages = [r.getMessage() for r in amp_log_records(caplog)]
    assert any(OVERFLOW_MSG.search(m) for m in messages), messages


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_overflow_silent_at_verbosity_zero(half, caplog):
    caplog.set_level(logging.DEBUG)
    model, opt = _dynamic("O1", half, verbosity=0)
    _overflow_step(model, opt, "loss_inf")
    assert _scaler()[0] == 32768.0
    assert amp_log_records(caplog) == []


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_step_after_skipped_step_is_normal(half, opt_level):
    model, opt = _dynamic(opt_level, half)
    _overflow_step(model, opt, "loss_inf")
    before = _snapshot(model, opt)
    _clean_step(model, opt, seed=1)
    after = _snapshot(model, opt)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(torch.isfinite(a).all() for a in after)
    assert _scaler() == (32768.0, 1)
    assert amp.skipped_steps(opt) == 1


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_consecutive_overflows_keep_halving(half):
    model, opt = _dynamic("O2", half)
    for expected in (32768.0, 16384.0, 8192.0):
        _overflow_step(model, opt, "loss_inf")
        assert _scaler()[0] == expected
    assert amp.skipped_steps(opt) == 3


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_min_loss_scale_floors_backoff(half):
    model, opt = _dynamic("O1", half, min_loss_scale=32768.0)
    _overflow_step(model, opt, "loss_inf")
    assert _scaler()[0] == 32768.0
    _overflow_step(model, opt, "loss_inf")
    assert _scaler()[0] == 32768.0


# ---------------------------------------------------------------- growth


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_scale_doubles_after_2000_unskipped_steps(half, opt_level):
    model, opt = _dynamic(opt_level, half)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1998}})
    _clean_step(model, opt, seed=0)
    assert _scaler() == (65536.0, 1999)
    _clean_step(model, opt, seed=1)
    assert _scaler() == (131072.0, 0)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_growth_capped_by_max_loss_scale(half):
    model, opt = _dynamic("O1", half, max_loss_scale=65536.0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1999}})
    _clean_step(model, opt)
    assert _scaler() == (65536.0, 0)


# ---------------------------------------------------------------- state dict


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_load_state_dict_restores_scale(half):
    model, opt = _dynamic("O2", half)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(
            scaled.detach().reshape(loss.shape), loss.detach() * 1024.0, rtol=0, atol=0
        )
        scaled.backward()
    opt.step()
    assert _scaler() == (1024.0, 8)


def test_state_dict_values_are_python_numbers():
    _dynamic("O1", torch.float16)
    entry = amp.state_dict()["loss_scaler0"]
    assert type(entry["loss_scale"]) is float
    assert type(entry["unskipped"]) is int


def test_load_state_dict_unknown_key_raises():
    _dynamic("O1", torch.float16)
    with pytest.raises(RuntimeError, match=r"(?i)unexpected key.*bogus"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "bogus": {}})


# ---------------------------------------------------------------- static scale


@pytest.mark.parametrize("device", DEVICES)
def test_static_scale_fp32_grads_are_unscaled_exactly(device):
    ref = tiny_mlp().to(device)
    model = tiny_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=128.0, verbosity=0)
    x, y = batch(0, device=device)
    F.mse_loss(ref(x), y).backward()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(
            scaled.detach().reshape(loss.shape), loss.detach() * 128.0, rtol=0, atol=0
        )
        scaled.backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_static_scale_grads_match_fp32_reference(device, half, opt_level):
    ref = tiny_mlp().to(device)
    model = tiny_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=half, loss_scale=128.0, verbosity=0
    )
    assert _scaler()[0] == 128.0
    x, y = batch(0, device=device)
    F.mse_loss(ref(x), y).backward()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for m, r in zip(amp.master_params(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(m.grad.float(), r.grad, **CHAIN_TOL[half])


@pytest.mark.parametrize("loss_scale", [128.0, "dynamic"])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_scaled_loss_keeps_shape_and_is_fp32(opt_level, loss_scale):
    """Apex yields ``loss.float() * loss_scale``: same shape as the loss, fp32."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model,
        opt,
        opt_level=opt_level,
        half_dtype=torch.float16,
        loss_scale=loss_scale,
        verbosity=0,
    )
    x, y = batch(0)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.shape == loss.shape
        assert scaled.dtype == torch.float32
        scaled.backward()


def test_static_scale_counts_unskipped_steps_like_apex():
    """Apex's LossScaler.update_scale increments ``unskipped`` for static scales too
    (only the growth is gated on ``dynamic``), so checkpoints carry the same numbers."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale=128.0, verbosity=0
    )
    for seed in range(2):
        _clean_step(model, opt, seed=seed)
    assert _scaler() == (128.0, 2)


def test_static_scale_never_changes_on_overflow():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale=128.0, verbosity=0
    )
    _overflow_step(model, opt, "loss_inf")
    assert _scaler()[0] == 128.0


def test_scaling_rescues_fp16_gradients_that_would_underflow():
    """O2 fp16: a weight gradient of ~1e-8 flushes to zero in fp16 unless the loss is scaled."""
    x = torch.full((1, 1), 1e-4)
    expected = float(x.half().float()) * 1e-4  # d(1e-4 * w * x)/dw with the half-rounded x

    results = {}
    for scale in (1.0, "dynamic"):
        model = torch.nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(
            model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=scale, verbosity=0
        )
        loss = model(x).sum() * 1e-4
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        results[scale] = float(next(iter(amp.master_params(opt))).grad)
    assert results[1.0] == 0.0  # the unscaled fp16 gradient underflows
    assert results["dynamic"] == pytest.approx(expected, rel=2e-3)


# ---------------------------------------------------------------- several losses


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_num_losses_two_have_separate_scalers(half, opt_level):
    model, opt = _dynamic(opt_level, half, num_losses=2)
    sd = amp.state_dict()
    assert set(sd) == {"loss_scaler0", "loss_scaler1"}
    assert _scaler(0) == (65536.0, 0) and _scaler(1) == (65536.0, 0)
    before = _snapshot(model, opt)

    x, y = batch(0)
    out = model(x)
    loss0 = F.mse_loss(out, y)
    loss1 = out.float().sum() * float("inf")
    with amp.scale_loss(loss0, opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with amp.scale_loss(loss1, opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()

    assert _scaler(0) == (65536.0, 1)
    assert _scaler(1) == (32768.0, 0)
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), (
        "step must be skipped"
    )

    _clean_step(model, opt, seed=1, loss_id=1)
    assert _scaler(1) == (32768.0, 1)
    assert _scaler(0) == (65536.0, 1)


def test_num_losses_state_dict_round_trip():
    _dynamic("O1", torch.float16, num_losses=2)
    target = {
        "loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
        "loss_scaler1": {"loss_scale": 2048.0, "unskipped": 11},
    }
    amp.load_state_dict(target)
    assert amp.state_dict() == target


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_overflow_skips_every_optimizer_in_a_list(half, opt_level):
    kw = {"loss_scale": "dynamic"} if half == torch.bfloat16 else {}
    model = tiny_mlp()
    o_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    o_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, (o_a, o_b) = amp.initialize(
        model, [o_a, o_b], opt_level=opt_level, half_dtype=half, verbosity=0, **kw
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    model[2].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    with amp.scale_loss(F.mse_loss(model(x), y), [o_a, o_b]) as scaled:
        scaled.backward()
    o_a.step()
    o_b.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    assert amp.skipped_steps(o_a) == 1 and amp.skipped_steps(o_b) == 1
    assert _scaler()[0] == 32768.0


# ---------------------------------------------------------------- no fused unscale kernel


@pytest.fixture
def unscale_without_bf16(monkeypatch):
    """PyTorch's fused unscale as its CUDA build has it: no bfloat16 kernel (it raises before
    writing anything), on any device, so that CPU runs take the scaler's other path."""
    from amp_core import _overflow_checks as checks_module

    fused = torch._amp_foreach_non_finite_check_and_unscale_
    calls = {"refused": 0}

    def without_bf16(grads, found_inf, inv_scale):
        if grads and grads[0].dtype == torch.bfloat16:
            calls["refused"] += 1
            raise NotImplementedError(
                "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
            )
        fused(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", without_bf16)
    monkeypatch.setattr(checks_module, "_NO_FUSED_UNSCALE", set())
    return calls


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_bf16_grads_unscale_where_torch_has_no_bf16_kernel(opt_level, unscale_without_bf16):
    ref = tiny_mlp()
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=torch.bfloat16, loss_scale=128.0,
        verbosity=0,
    )  # fmt: skip
    x, y = batch(0)
    F.mse_loss(ref(x), y).backward()
    for _ in range(2):  # the second step goes straight to the other path
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        for m, r in zip(amp.master_params(opt), ref.parameters(), strict=True):
            torch.testing.assert_close(m.grad.float(), r.grad, **CHAIN_TOL[torch.bfloat16])
    # Only O3 has bf16 grads at unscale time (O1/O2 unscale fp32 grads or masters); the op is
    # tried once and then remembered as missing.
    assert unscale_without_bf16["refused"] == (1 if opt_level == "O3" else 0)


@pytest.mark.parametrize("inject", ["grad_inf", "grad_nan"])
def test_bf16_overflow_found_where_torch_has_no_bf16_kernel(inject, unscale_without_bf16):
    model, opt = _dynamic("O3", torch.bfloat16)
    _clean_step(model, opt)
    before = _snapshot(model, opt)
    _overflow_step(model, opt, inject)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), before, strict=True))
    assert _scaler() == (32768.0, 0)
    assert amp.skipped_steps(opt) == 1
    assert unscale_without_bf16["refused"] == 1
