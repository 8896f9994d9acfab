"""FP16_Optimizer: masters, mixed groups, scaling, overflow, closures, checkpoints.

References are fp32 computations written out in the tests (the same SGD update applied to an
fp32 copy of the model), compared with per-dtype tolerances from ``_legacy_helpers``.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, DEVICES, HALF_DTYPES

from _legacy_helpers import MixedNet, batch, fp32_copy, tiny_mlp
from amp_legacy_fp16 import FP16_Optimizer


def _wrap(model, opt_cls=torch.optim.SGD, groups=None, **kw):
    kw.setdefault("verbose", False)
    params = groups if groups is not None else model.parameters()
    inner = opt_cls(params, **({"lr": 0.1} if opt_cls is torch.optim.SGD else {}))
    return FP16_Optimizer(inner, **kw)


def _loss(model, seed, device="cpu"):
    x, y = batch(seed, device=device)
    dtype = next(model.parameters()).dtype  # the first layer's
    return F.mse_loss(model(x.to(dtype)).float(), y)


def _snapshot(opt):
    params = [p for g in opt.fp16_groups for p in g]
    params += [p for g in opt.param_groups for p in g["params"]]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    return [p.detach().clone() for p in params], state


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_groups_of_half_and_fp32_params(half):
    model = MixedNet(half)
    groups = [
        {"params": model.fc1.parameters(), "lr": 0.1},
        {"params": model.fc2.parameters(), "lr": 0.01, "momentum": 0.9},
    ]
    opt = _wrap(model, groups=groups)
    assert [len(g) for g in opt.fp16_groups] == [2, 0]
    assert [len(g) for g in opt.fp32_from_fp32_groups] == [0, 2]
    for half_p, master in zip(opt.fp16_groups[0], opt.fp32_from_fp16_groups[0], strict=True):
        assert master.dtype == torch.float32 and torch.equal(master, half_p.float())
    assert opt.param_groups[0]["params"] == opt.fp32_from_fp16_groups[0]
    assert opt.param_groups[1]["params"][0] is model.fc2.weight
    assert opt.param_groups[1]["lr"] == 0.01 and opt.state is opt.optimizer.state


def test_constructor_warns_and_rejects_bad_inputs():
    with pytest.warns(FutureWarning, match='opt_level="O2"'):
        _wrap(tiny_mlp(torch.float16))
    with pytest.raises(TypeError, match="convert_network"):
        _wrap(torch.nn.Linear(2, 2).double())
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        FP16_Optimizer([torch.nn.Parameter(torch.ones(1))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown key"):
        _wrap(tiny_mlp(torch.float16), dynamic_loss_scale=True, dynamic_loss_args={"init": 1})


def test_dynamic_loss_args_are_forwarded():
    opt = _wrap(
        tiny_mlp(torch.float16),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 1024.0, "scale_window": 5},
    )
    assert opt.loss_scale == 1024.0 and opt.loss_scaler.scale_window == 5


def test_verbose_logs_instead_of_printing(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="amp_legacy_fp16"):
        _wrap(MixedNet(torch.float16), verbose=True)
    text = caplog.text
    assert "processing param group 0" in text and "torch.float16" in text
    assert "torch.float32" in text
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ one step vs fp32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_step_matches_fp32_sgd(device, half, dynamic):
    model = MixedNet(half).to(device)
    ref = fp32_copy(model)
    kw = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**10}}
    opt = _wrap(model, **(kw if dynamic else {"static_loss_scale": 64.0}))
    opt.zero_grad()
    opt.backward(_loss(model, 1, device))
    opt.step()

    _loss(ref, 1, device).backward()
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in ref.parameters()]
    got = opt.fp32_from_fp16_groups[0] + opt.fp32_from_fp32_groups[0]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.detach(), e, **CHAIN_TOL[half])
    # the half params are the masters, rounded
    for p, m in zip(opt.fp16_groups[0], opt.fp32_from_fp16_groups[0], strict=True):
        assert torch.equal(p, m.to(half))


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_master_grads_are_unscaled(half):
    model = MixedNet(half)
    ref = fp32_copy(model)
    opt = _wrap(model, static_loss_scale=256.0)
    opt.backward(_loss(model, 2))
    grads = opt.inspect_master_grad_data()
    _loss(ref, 2).backward()
    flat = [g for group in grads for g in group]
    for g, p in zip(flat, ref.parameters(), strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, p.grad, **CHAIN_TOL[half])


# ------------------------------------------------------------------ overflow


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("where", ["half", "fp32"])
def test_overflow_skips_step_and_lowers_scale(half, where):
    model = MixedNet(half)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**8},
        verbose=False,
    )
    opt.zero_grad()
    opt.backward(_loss(model, 0))
    opt.step()  # momentum state exists now
    before, state = _snapshot(opt)

    target = model.fc1.weight if where == "half" else model.fc2.bias
    handle = target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    opt.zero_grad()
    opt.backward(_loss(model, 1))
    handle.remove()
    assert opt.overflow is True
    assert opt.inspect_master_grad_data() is None
    assert opt.clip_master_grads(1.0) == -1
    opt.step()
    assert opt.loss_scale == 2.0**7
    after, state_after = _snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for key in state:
        for name in state[key]:
            assert torch.equal(state[key][name], state_after[key][name])

    opt.zero_grad()
    opt.backward(_loss(model, 2))
    assert opt.overflow is False
    opt.step()
    assert not torch.equal(model.fc1.weight, before[0])


def test_fp16_default_scale_overflows_down_to_a_working_one():
    model = tiny_mlp(torch.float16)
    opt = _wrap(model, dynamic_loss_scale=True)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = _loss(model, 0)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    assert opt.loss_scale < 2.0**32  # 2**32 overflows fp16 grads: skipped and lowered
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------ several losses


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_deferred_master_update_equals_summed_loss(half):
    a, b = MixedNet(half), MixedNet(half)
    ref = fp32_copy(a)
    opt_a = _wrap(a, static_loss_scale=32.0)
    opt_b = _wrap(b, static_loss_scale=32.0)

    opt_a.zero_grad()
    opt_a.backward(_loss(a, 1), update_master_grads=False)
    opt_a.backward(_loss(a, 2), update_master_grads=False)
    opt_a.update_master_grads()
    opt_b.zero_grad()
    opt_b.backward(_loss(b, 1) + _loss(b, 2))
    (_loss(ref, 1) + _loss(ref, 2)).backward()

    grads_a = [g for grp in opt_a.inspect_master_grad_data() for g in grp]
    grads_b = [g for grp in opt_b.inspect_master_grad_data() for g in grp]
    for ga, gb, p in zip(grads_a, grads_b, ref.parameters(), strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ga, p.grad, **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_two_updating_backwards_accumulate_once_unscaled(half):
    model = MixedNet(half)
    ref = fp32_copy(model)
    opt = _wrap(model, static_loss_scale=64.0)
    opt.zero_grad()
    opt.backward(_loss(model, 1))
    opt.backward(_loss(model, 2))  # Apex divided the fp32 grads of the first loss twice
    (_loss(ref, 1) + _loss(ref, 2)).backward()
    grads = [g for grp in opt.inspect_master_grad_data() for g in grp]
    for g, p in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, **CHAIN_TOL[half])


# ------------------------------------------------------------------ grads


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_clip_master_grads_matches_fp32_norm(half):
    model = MixedNet(half)
    ref = fp32_copy(model)
    opt = _wrap(model, static_loss_scale=16.0)
    opt.backward(_loss(model, 3) * 50)
    (_loss(ref, 3) * 50).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    total = opt.clip_master_grads(1.0)
    assert total == pytest.approx(expected, rel=CHAIN_TOL[half]["rtol"])
    grads = [g for grp in opt.inspect_master_grad_data() for g in grp]
    assert torch.nn.utils.get_total_norm(grads).item() == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("to_none", [False, True])
def test_zero_grad(to_none):
    model = MixedNet(torch.float16)
    opt = _wrap(model)
    opt.backward(_loss(model, 0))
    opt.zero_grad(set_grads_to_None=to_none)
    everything = [p for g in opt.param_groups for p in g["params"]] + opt.all_fp16_params
    for p in everything:
        assert (p.grad is None) if to_none else torch.count_nonzero(p.grad) == 0


def test_loss_scale_is_writable():
    opt = _wrap(tiny_mlp(torch.float16), dynamic_loss_scale=True)
    opt.loss_scale = 128.0
    assert opt.loss_scale == 128.0 and opt.loss_scaler.loss_scale == 128.0


# ------------------------------------------------------------------ closures


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_sgd_closure_equals_plain_steps(half):
    a, b = tiny_mlp(half), tiny_mlp(half)
    opt_a = _wrap(a, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**8})
    opt_b = _wrap(b, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**8})
    for step in range(4):

        def closure(step=step):
            opt_a.zero_grad()
            loss = _loss(a, step)
            opt_a.backward(loss)
            return loss

        returned = opt_a.step(closure)
        opt_b.zero_grad()
        loss_b = _loss(b, step)
        opt_b.backward(loss_b)
        opt_b.step()
        assert returned.item() == loss_b.item()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_lbfgs_reaches_the_fp32_least_squares_solution(half):
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = x @ torch.tensor([[0.5], [-1.0], [0.25]]) + 0.3
    model = torch.nn.Linear(3, 1).to(half)
    opt = FP16_Optimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=10),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**8},
        verbose=False,
    )
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(half)).float(), y)
        opt.backward(loss)
        return loss

    for _ in range(5):
        opt.step(closure)
    assert len(calls) > 5  # LBFGS evaluates several times per step
    design = torch.cat([x, torch.ones(64, 1)], dim=1).double()
    solution = torch.linalg.lstsq(design, y.double()).solution.flatten().float()
    master = torch.cat([m.flatten() for m in opt.fp32_from_fp16_groups[0]])
    # The masters sit where the half forward's gradient vanishes: the fp32 optimum up to the
    # rounding of x and of the weights seen by the forward (a few half ulps).
    torch.testing.assert_close(master.detach(), solution, rtol=0, atol=0.05)
    assert torch.equal(model.weight, opt.fp32_from_fp16_groups[0][0].to(half))


def test_closure_recovers_after_an_overflow_outside_it():
    model = tiny_mlp(torch.float16)
    opt = _wrap(model, dynamic_loss_scale=True)  # 2**32: every fp16 backward overflows at first

    def closure():
        opt.zero_grad()
        loss = _loss(model, 0)
        opt.backward(loss)
        return loss

    closure()
    assert opt.overflow
    before = [p.clone() for p in model.parameters()]
    for _ in range(3):
        opt.step(closure)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_casting_the_model_there_and_back_after_wrapping_keeps_training_it(half):
    # This FP16_Optimizer holds the model's Parameter objects (not views of a buffer of its
    # own): a cast that gives them new data (model.float() then back) leaves it working.
    model = tiny_mlp(half)
    ref = fp32_copy(model)
    opt = _wrap(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10})
    model.float()
    model.to(half)
    opt.zero_grad()
    opt.backward(_loss(model, 1))
    opt.step()

    _loss(ref, 1).backward()
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in ref.parameters()]
    for p, e in zip(model.parameters(), expected, strict=True):
        assert p.dtype == half
        torch.testing.assert_close(p.detach().float(), e, **CHAIN_TOL[half])


def _train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss = _loss(model, step)
        if step == 3:
            loss = loss * float("inf")  # one overflow, so the scaler state matters
        opt.backward(loss)
        opt.step()


def _build(half):
    model = MixedNet(half)
    opt = FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 3},
        verbose=False,
    )
    return model, opt


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_state_dict_resumes_bitwise(half):
    model, opt = _build(half)
    _train(model, opt, range(0, 6))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _train(model, opt, range(6, 12))

    resumed_model, resumed_opt = _build(half)
    with torch.no_grad():  # make sure nothing of the fresh build survives the load
        for p in resumed_model.parameters():
            p.add_(1.0)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    _train(resumed_model, resumed_opt, range(6, 12))

    assert resumed_opt.loss_scale == opt.loss_scale
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        opt.all_fp32_from_fp16_params, resumed_opt.all_fp32_from_fp16_params, strict=True
    ):
        assert torch.equal(a, b)


def test_load_state_dict_errors_name_the_fix():
    _, opt = _build(torch.float16)
    with pytest.raises(KeyError, match="state_dict"):
        opt.load_state_dict({"loss_scaler": {}})
    other = FP16_Optimizer(
        torch.optim.Adam(tiny_mlp(torch.float16).parameters()), verbose=False
    ).state_dict()
    with pytest.raises(ValueError, match="Build the model and the optimizer exactly"):
        opt.load_state_dict(other)


def test_pickling_raises_with_advice():
    _, opt = _build(torch.float16)
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(opt)


# ------------------------------------------------------------------ impossible values


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -2.0])
def test_loss_scale_setter_refuses_what_no_scale_can_be(value):
    opt = _wrap(tiny_mlp(torch.float16), dynamic_loss_scale=True)
    scale = opt.loss_scale
    with pytest.raises(ValueError, match="loss scale must be positive and finite"):
        opt.loss_scale = value
    assert opt.loss_scale == scale


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_load_state_dict_refuses_a_bad_loss_scale_and_loads_nothing(value):
    _, source = _build(torch.float16)
    saved = source.state_dict()
    saved["loss_scaler"] = {**saved["loss_scaler"], "cur_scale": value, "cur_iter": 9}
    model, opt = _build(torch.float16)
    before = [p.detach().clone() for p in model.parameters()], opt.loss_scale
    with pytest.raises(ValueError, match="cur_scale"):
        opt.load_state_dict(saved)
    assert opt.loss_scale == before[1] and opt.loss_scaler.cur_iter == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before[0], strict=True))


def test_load_state_dict_refuses_a_flag_that_is_not_a_bool():
    _, opt = _build(torch.float16)
    saved = opt.state_dict()
    with pytest.raises(TypeError, match="overflow"):
        opt.load_state_dict({**saved, "overflow": "no"})
