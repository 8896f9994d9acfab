"""O2 (half model, fp32 masters) and O3 (everything half, no masters)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, DEVICES, HALF_DTYPES, OP_TOL

from _amp_core_helpers import batch, tiny_bn_net, tiny_mlp
from amp_core import amp


def _init(opt_level, half, model=None, device="cpu", opt_cls=torch.optim.SGD, **kw):
    model = (model if model is not None else tiny_mlp()).to(device)
    opt = opt_cls(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kw)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_forward_casts_inputs_and_returns_fp32(device, half, opt_level):
    ref = copy.deepcopy(tiny_mlp()).to(device=device, dtype=half)
    model, _ = _init(opt_level, half, device=device)
    seen = {}

    def record_input_dtype(module, args):
        seen["in"] = args[0].dtype

    model[0].register_forward_pre_hook(record_input_dtype)
    x, _ = batch(0, device=device)
    out = model(x)
    assert seen["in"] == half
    assert out.dtype == torch.float32
    with torch.no_grad():
        expected = ref(x.to(half)).float()
    torch.testing.assert_close(out.detach(), expected, **OP_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_cast_model_outputs(half, opt_level):
    model, _ = _init(opt_level, half, cast_model_outputs=half)
    assert model(batch(0)[0]).dtype == half


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_forward_casts_nested_inputs_and_leaves_integers(half):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, inputs):
            x, idx = inputs["x"], inputs["idx"]
            assert idx.dtype == torch.int64
            return {"out": self.lin(x)[idx], "dtype_in": x.dtype}

    model, _ = _init("O2", half, model=Net())
    res = model({"x": torch.randn(5, 4), "idx": torch.tensor([0, 2])})
    assert res["dtype_in"] == half
    assert res["out"].dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_batchnorm_runs_on_half_activations(half):
    model, _ = _init("O2", half, model=tiny_bn_net())
    out = model(torch.randn(6, 4))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert model[1].running_mean.dtype == torch.float32


# ---------------------------------------------------------------- master weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_optimizer_holds_fp32_masters(device, half):
    fp32 = tiny_bn_net().to(device)
    originals = [p.detach().clone() for p in fp32.parameters()]
    model, opt = _init("O2", half, model=fp32, device=device)
    masters = list(amp.master_params(opt))
    model_params = list(model.parameters())
    assert len(masters) == len(model_params)
    assert all(m.dtype == torch.float32 for m in masters)
    group_ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert group_ids == [id(m) for m in masters]
    for m, p, o in zip(masters, model_params, originals, strict=True):
        assert m.shape == p.shape
        # Masters hold the fp32 value (or its half rounding): either way they round
        # to the model param.
        assert torch.equal(m.to(p.dtype), p.detach())
        torch.testing.assert_close(m, o, **OP_TOL[half])
    # fp32 (batchnorm) params need no separate master.
    bn_w = model[1].weight
    assert any(m is bn_w or torch.equal(m, bn_w) for m in masters)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_step_updates_masters_and_copies_to_model(device, half):
    ref = tiny_mlp().to(device)
    model, opt = _init("O2", half, device=device)
    x, y = batch(0, device=device)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for m in amp.master_params(opt):
        assert m.grad is not None and m.grad.dtype == torch.float32
    opt.step()

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()

    for p, m, r in zip(model.parameters(), amp.master_params(opt), ref.parameters(), strict=True):
        assert torch.equal(p.detach(), m.detach().to(p.dtype)), "model param != master cast to half"
        torch.testing.assert_close(m.detach(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_masters_accumulate_below_half_resolution(half):
    """Many tiny updates: fp32 masters keep them, a pure-half weight would not."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model, opt = _init("O2", half, model=model, loss_scale=1.0)
    opt.param_groups[0]["lr"] = 1.0
    step = 2.0**-12  # below the spacing of both fp16 (2^-10) and bf16 (2^-7) at 1.0
    for _ in range(64):
        opt.zero_grad()
        loss = model(torch.full((1, 1), step)).sum()  # d loss / d w = step
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    master = next(iter(amp.master_params(opt)))
    torch.testing.assert_close(
        master.detach(), torch.full((1, 1), 1.0 - 64 * step), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_state_dict_is_fp32_masters(half):
    model, opt = _init("O2", half, model=tiny_bn_net())
    x, y = batch(3)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    sd = model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    for name, m in zip(names, amp.master_params(opt), strict=True):
        assert sd[name].dtype == torch.float32, name
        assert torch.equal(sd[name], m.detach()), name
    assert sd["1.running_mean"].dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_load_state_dict_restores_masters_bitwise(half):
    model, opt = _init("O2", half, model=tiny_bn_net(0))
    for seed in range(3):
        opt.zero_grad()
        x, y = batch(seed)
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [m.detach().clone() for m in amp.master_params(opt)]

    fresh, fresh_opt = _init("O2", half, model=tiny_bn_net(7))
    fresh.load_state_dict(sd)
    for a, b in zip(amp.master_params(fresh_opt), masters, strict=True):
        assert torch.equal(a.detach(), b)
    for p, b in zip(fresh.parameters(), masters, strict=True):
        assert torch.equal(p.detach(), b.to(p.dtype))


# ---------------------------------------------------------------- O3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_master_params_are_model_params(device, half):
    model, opt = _init("O3", half, model=tiny_bn_net(), device=device)
    masters = list(amp.master_params(opt))
    assert [id(m) for m in masters] == [id(p) for p in model.parameters()]
    assert all(m.dtype == half for m in masters)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_step_updates_half_params(half):
    model, opt = _init("O3", half)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(4)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss)  # O3: loss scale 1.0
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert p.dtype == half
        # plain SGD on the half params, one rounding to half
        torch.testing.assert_close(
            p.detach(), (b.float() - 0.1 * g.float()).to(half), **OP_TOL[half]
        )
    assert any(
        not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True)
    )


# ---------------------------------------------------------------- several models / optimizers


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_two_models_two_optimizers_o2(half):
    r1, r2 = tiny_mlp(0), tiny_mlp(1, din=3)
    m1, m2 = copy.deepcopy(r1), copy.deepcopy(r2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    [m1, m2], [o1, o2] = amp.initialize(
        [m1, m2], [o1, o2], opt_level="O2", half_dtype=half, verbosity=0
    )
    assert all(p.dtype == half for p in list(m1.parameters()) + list(m2.parameters()))
    assert all(
        m.dtype == torch.float32 for m in list(amp.master_params(o1)) + list(amp.master_params(o2))
    )

    x, y = batch(5)
    loss = F.mse_loss(m2(m1(x)), y)
    with amp.scale_loss(loss, [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()

    ro1 = torch.optim.SGD(r1.parameters(), lr=0.1)
    ro2 = torch.optim.SGD(r2.parameters(), lr=0.1)
    F.mse_loss(r2(r1(x)), y).backward()
    ro1.step()
    ro2.step()
    for m, r in zip(
        list(amp.master_params(o1)) + list(amp.master_params(o2)),
        list(r1.parameters()) + list(r2.parameters()),
        strict=True,
    ):
        torch.testing.assert_close(m.detach(), r.detach(), **CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_forward_casts_keyword_inputs_and_tuple_outputs(half, opt_level):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, *, extra):
            assert x.dtype == half and extra.dtype == half
            h = self.lin(x + extra)
            return h, h.sum()

    model, _ = _init(opt_level, half, model=Net())
    out, total = model(torch.randn(2, 4), extra=torch.randn(2, 4))
    assert out.dtype == torch.float32 and total.dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_unused_parameters_are_left_alone(half, opt_level):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 3)
            self.unused = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model, opt = _init(opt_level, half, model=Net())
    unused_before = [p.detach().clone() for p in model.unused.parameters()]
    used_before = [p.detach().clone() for p in model.used.parameters()]
    x, y = batch(8)
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(
        torch.equal(p.detach(), b)
        for p, b in zip(model.unused.parameters(), unused_before, strict=True)
    )
    assert all(
        not torch.equal(p.detach(), b)
        for p, b in zip(model.used.parameters(), used_before, strict=True)
    )
    assert amp.skipped_steps(opt) == 0
