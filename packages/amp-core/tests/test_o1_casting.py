"""O1: Apex's casting policy on the thread that called amp.initialize, CPU and CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, DEVICES, HALF_DTYPES, OP_TOL

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp


def _o1(half, device="cpu", **kw):
    model = tiny_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0, **kw)


# ---------------------------------------------------------------- half ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_matmul_linear_conv_run_in_half(device, half):
    torch.manual_seed(0)
    a = torch.randn(3, 5, device=device)
    w = torch.randn(4, 5, device=device)
    b = torch.randn(4, device=device)
    img = torch.randn(2, 3, 6, 6, device=device)
    k = torch.randn(4, 3, 3, 3, device=device)
    # References computed directly in the half dtype, before amp is switched on.
    ref_mm = a.to(half) @ w.t().to(half)
    ref_lin = F.linear(a.to(half), w.to(half), b.to(half))
    ref_conv = F.conv2d(img.to(half), k.to(half))
    _o1(half, device)

    mm = a @ w.t()
    lin = F.linear(a, w, b)
    conv = F.conv2d(img, k)
    assert mm.dtype == half and lin.dtype == half and conv.dtype == half
    torch.testing.assert_close(mm, ref_mm, **OP_TOL[half])
    torch.testing.assert_close(lin, ref_lin, **OP_TOL[half])
    torch.testing.assert_close(conv, ref_conv, **OP_TOL[half])
    assert torch.matmul(a, w.t()).dtype == half
    assert torch.nn.Linear(5, 2).to(device)(a).dtype == half


def _fp32_ops():
    target = torch.tensor([0, 2, 1])
    return {
        "softmax": lambda t: torch.softmax(t, dim=-1),
        "F.softmax": lambda t: F.softmax(t, dim=-1),
        "log_softmax": lambda t: F.log_softmax(t, dim=-1),
        "layer_norm": lambda t: F.layer_norm(t, (t.shape[-1],)),
        "group_norm": lambda t: F.group_norm(t.reshape(3, 4, 1), 2),
        "exp": torch.exp,
        "log": lambda t: torch.log(t.abs()),  # abs is exact in every dtype
        "pow": lambda t: torch.pow(t, 2),
        "sum": torch.sum,
        "Tensor.sum": lambda t: t.sum(),
        "cumsum": lambda t: torch.cumsum(t, dim=0),
        "norm": torch.norm,
        "mse_loss": lambda t: F.mse_loss(t, t.flip(0)),
        "cross_entropy": lambda t: F.cross_entropy(t, target.to(t.device)),
    }


FP32_OP_NAMES = list(_fp32_ops())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("name", FP32_OP_NAMES)
def test_fp32_ops_return_fp32_from_half_input(device, half, name):
    op = _fp32_ops()[name]
    torch.manual_seed(0)
    x = (torch.randn(3, 4) * 0.5).to(device=device, dtype=half)
    # Reference: the same op in float32 on the exactly representable half values.
    ref = op(x.float())
    _o1(half, device)
    out = op(x)
    assert out.dtype == torch.float32, f"{name} returned {out.dtype}"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_fp32_op_on_output_of_half_op(device, half):
    """softmax of a linear's (half) output is fp32, as in a model's forward."""
    a = torch.randn(3, 5, device=device)
    w = torch.randn(4, 5, device=device)
    _o1(half, device)
    h = F.linear(a, w)
    assert h.dtype == half
    s = torch.softmax(h, dim=-1)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, torch.softmax(h.float(), dim=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_mixed_binary_ops_promote_to_fp32(device, half):
    f = torch.randn(2, 3, device=device)
    h = torch.randn(2, 3, device=device).to(half)
    ref_add = f + h.float()
    ref_mul = f * h.float()
    _o1(half, device)
    add, mul = f + h, h * f
    cat = torch.cat([f, h])
    assert add.dtype == mul.dtype == cat.dtype == torch.float32
    torch.testing.assert_close(add, ref_add, rtol=0, atol=0)
    torch.testing.assert_close(mul, ref_mul, rtol=0, atol=0)
    torch.testing.assert_close(cat, torch.cat([f, h.float()]), rtol=0, atol=0)
    assert torch.add(h, f).dtype == torch.float32
    assert torch.stack([h, f]).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_binary_cross_entropy_refused_with_advice_for_half_inputs(device, half):
    p = torch.sigmoid(torch.randn(4, 3, device=device))
    t = torch.rand(4, 3, device=device)
    _o1(half, device)
    # As Apex: NotImplementedError, raised only when an input is half.
    with pytest.raises(NotImplementedError, match=r"BCEWithLogitsLoss"):
        F.binary_cross_entropy(p.to(half), t)
    with pytest.raises(NotImplementedError, match=r"BCEWithLogitsLoss"):
        torch.nn.BCELoss()(p, t.to(half))
    # A half op's output (a Linear under O1) fed to BCELoss is refused too.
    lin = torch.nn.Linear(3, 3).to(device)
    with pytest.raises(NotImplementedError, match=r"BCEWithLogitsLoss"):
        F.binary_cross_entropy(torch.sigmoid(lin(p)), t)
    # The recommended replacement works and is computed in fp32.
    out = F.binary_cross_entropy_with_logits(torch.randn(4, 3, device=device).to(half), t)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_binary_cross_entropy_runs_on_fp32_inputs_under_o1(device, half):
    p = torch.sigmoid(torch.randn(4, 3, device=device))
    t = torch.rand(4, 3, device=device)
    # Reference from the closed form, before amp is switched on.
    expected = -(t * p.log() + (1 - t) * (1 - p).log()).mean()
    _o1(half, device)
    out = F.binary_cross_entropy(p, t)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.nn.BCELoss()(p, t), expected)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_binary_cross_entropy_allowed_outside_o1(half):
    amp.initialize(tiny_mlp(), opt_level="O2", half_dtype=half, verbosity=0)
    p = torch.sigmoid(torch.randn(4, 3))
    t = torch.rand(4, 3)
    torch.testing.assert_close(F.binary_cross_entropy(p, t), torch.nn.BCELoss()(p, t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_disable_casts(device, half):
    a = torch.randn(3, 5, device=device)
    w = torch.randn(4, 5, device=device)
    ref = F.linear(a, w)
    _o1(half, device)
    with amp.disable_casts():
        out = F.linear(a, w)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert F.linear(a, w).dtype == half


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_does_not_patch_functions(half):
    amp.initialize(tiny_mlp(), opt_level="O2", half_dtype=half, verbosity=0)
    assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.float32
    assert torch.softmax(torch.randn(2, 3).to(half), -1).dtype == half


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_casting_in_loss_outside_forward(half):
    """Loss computed outside model.forward is covered (Apex patched torch globally)."""
    model, _ = _o1(half)
    x, y = batch(0)
    out = model(x)
    assert out.dtype == half
    loss = F.mse_loss(out, y)
    assert loss.dtype == torch.float32


# ---------------------------------------------------------------- model forward/backward parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_forward_backward_matches_fp32(device, half):
    ref = tiny_mlp().to(device)
    x, y = batch(0, device=device)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()

    model, opt = _o1(half, device)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **CHAIN_TOL[half])
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, r.grad, **CHAIN_TOL[half])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_weight_cast_cache_is_not_stale_after_step(device, half):
    model, opt = _o1(half, device)
    x, y = batch(1, device=device)
    out1 = model(x)
    loss = F.mse_loss(out1, y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    out2 = model(x)

    # Reference: a fresh fp32 twin holding the updated weights, run with the same casts.
    twin = tiny_mlp().to(device)
    twin.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        h = F.linear(x.to(half), twin[0].weight.to(half), twin[0].bias.to(half)).relu()
        expected = F.linear(h, twin[2].weight.to(half), twin[2].bias.to(half))
    assert not torch.equal(out2, out1), "the step did not change the output at all"
    torch.testing.assert_close(out2.detach(), expected, **OP_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_weight_cast_cache_not_stale_across_many_steps(half):
    model, opt = _o1(half)
    x, y = batch(2)
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        with torch.no_grad():
            w0 = model[0].weight
            expected0 = F.linear(x.to(half), w0.to(half), model[0].bias.to(half))
        got0 = model[0](x)
        torch.testing.assert_close(got0.detach(), expected0, **OP_TOL[half])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_batchnorm_and_layernorm_model_trains(device, half):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 3),
    ).to(device)
    ref = copy.deepcopy(model)
    x, y = batch(5, device=device)
    F.mse_loss(ref(x), y).backward()  # fp32 reference, before amp is switched on
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
    assert model[1].running_mean.dtype == torch.float32
    out = model(x)
    loss = F.mse_loss(out, y)
    assert out.dtype == half and loss.dtype == torch.float32
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, r.grad, **CHAIN_TOL[half])
    assert model[1].running_mean.dtype == torch.float32
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, **OP_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_weight_cast_cache_not_stale_after_load_state_dict_in_eval(half):
    """Evaluate, load other weights in place, evaluate again: the new weights must be used.

    This is Apex's open bug NVIDIA/apex#796 (stale O1 cast cache after eval + load), which
    the toolkit fixes.
    """
    model, _ = _o1(half)
    other = tiny_mlp(seed=42)
    x, _ = batch(6)
    model.eval()
    with torch.no_grad():
        model(x)
        model.load_state_dict(other.state_dict())  # in-place copy_ into the same tensors
        out = model(x)
        h = F.linear(x.to(half), other[0].weight.to(half), other[0].bias.to(half)).relu()
        expected = F.linear(h, other[2].weight.to(half), other[2].bias.to(half))
    torch.testing.assert_close(out, expected, **OP_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_weight_cast_cache_not_stale_after_manual_in_place_update(half):
    """An in-place weight edit between two forwards (no scale_loss in between) is seen."""
    model, _ = _o1(half)
    x, _ = batch(7)
    lin = model[0]
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-1.0)
    second = lin(x)
    expected = F.linear(x.to(half), lin.weight.detach().to(half), lin.bias.detach().to(half))
    assert not torch.equal(first, second)
    torch.testing.assert_close(second.detach(), expected, **OP_TOL[half])


def _apex_more_fp32_ops():
    """More of Apex's FP32_FUNCS (apex/amp/lists/{functional,torch}_overrides.py; not `mean`,
    which Apex dropped from the list for torch >= 1.1)."""
    target = torch.tensor([0, 2, 1])
    probs = torch.rand(3, 4, generator=torch.Generator().manual_seed(1))  # fp32 on purpose
    return {
        "Tensor.softmax": lambda t: t.softmax(-1),
        "Tensor.exp": lambda t: t.exp(),
        "expm1": torch.expm1,
        "rsqrt": lambda t: torch.rsqrt(t.abs()),
        "reciprocal": torch.reciprocal,
        "prod": torch.prod,
        "var": torch.var,
        "std": torch.std,
        "cumprod": lambda t: torch.cumprod(t, dim=0),
        "softplus": F.softplus,
        "l1_loss": lambda t: F.l1_loss(t, t.flip(0)),
        "smooth_l1_loss": lambda t: F.smooth_l1_loss(t, t.flip(0)),
        "kl_div": lambda t: F.kl_div(t, t.flip(0).abs(), reduction="batchmean"),
        "nll_loss": lambda t: F.nll_loss(t, target.to(t.device)),
        "cosine_similarity": lambda t: F.cosine_similarity(t, t.flip(0)),
        "bce_with_logits": lambda t: F.binary_cross_entropy_with_logits(t, probs.to(t.device)),
    }


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("name", list(_apex_more_fp32_ops()))
def test_more_apex_fp32_ops_return_fp32(half, name):
    op = _apex_more_fp32_ops()[name]
    torch.manual_seed(0)
    x = (torch.randn(3, 4) * 0.5).to(half)
    ref = op(x.float())
    _o1(half)
    out = op(x)
    assert out.dtype == torch.float32, f"{name} returned {out.dtype}"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Apex's other list entries


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_tensor_cpu_returns_fp32_for_half_tensor(half):
    h = torch.tensor([1.5, -2.25, 3.0], dtype=half)
    d = torch.tensor([1.0], dtype=torch.float64)
    _o1(half)
    out = h.cpu()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([1.5, -2.25, 3.0]), rtol=0, atol=0)
    assert d.cpu().dtype == torch.float64  # only half tensors are widened
    with amp.disable_casts():
        assert h.cpu().dtype == half


def test_tensor_cpu_restored_when_o1_switches_off():
    original = torch.Tensor.cpu
    _o1(torch.float16)
    assert torch.Tensor.cpu is not original
    amp.initialize(tiny_mlp(), opt_level="O0", verbosity=0)
    assert torch.Tensor.cpu is original
    assert "cpu" not in vars(torch.Tensor)
    assert torch.ones(2, dtype=torch.float16).cpu().dtype == torch.float16


_INPLACE_FP32_OPS = {
    "exp_": lambda t: t.exp_(),
    "log_": lambda t: t.log_(),
    "rsqrt_": lambda t: t.rsqrt_(),
    "reciprocal_": lambda t: t.reciprocal_(),
    "pow_": lambda t: t.pow_(2),
    "cumsum_": lambda t: t.cumsum_(0),
    "torch.exp_": torch.exp_,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("name", list(_INPLACE_FP32_OPS))
def test_inplace_fp32_op_on_half_tensor_refused(device, half, name):
    op = _INPLACE_FP32_OPS[name]
    h = torch.tensor([0.5, 1.0, 2.0], device=device, dtype=half)
    before = h.clone()
    _o1(half, device)
    with pytest.raises(NotImplementedError, match=r"in-place function"):
        op(h)
    torch.testing.assert_close(h, before, rtol=0, atol=0)  # nothing written
    # fp32 tensors run in place as before; a half exponent is widened.
    x = torch.tensor([0.5, 1.0, 2.0], device=device)
    expected = op(x.clone().double()).float()
    torch.testing.assert_close(op(x), expected)
    y = torch.tensor([1.5, 2.0], device=device)
    y.pow_(torch.tensor([2.0, 3.0], device=device, dtype=half))
    torch.testing.assert_close(y, torch.tensor([2.25, 8.0], device=device))
    with amp.disable_casts():
        assert op(h).dtype == half


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("cell", [torch.nn.GRUCell, torch.nn.LSTMCell, torch.nn.RNNCell])
def test_rnn_cells_run_in_half(half, cell):
    torch.manual_seed(0)
    layer = cell(4, 6)
    x = torch.randn(3, 4)
    ref = copy.deepcopy(layer).to(half)(x.to(half))
    _o1(half)
    out = layer(x)
    out, ref = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
    assert out.dtype == half
    torch.testing.assert_close(out, ref, **OP_TOL[half])
    out.float().sum().backward()
    assert layer.weight_ih.grad is not None and layer.weight_ih.grad.dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("rnn", [torch.nn.GRU, torch.nn.LSTM, torch.nn.RNN])
def test_rnns_run_in_half(half, rnn):
    torch.manual_seed(0)
    layer = rnn(4, 6, num_layers=2)
    x = torch.randn(5, 3, 4)
    ref, _ = copy.deepcopy(layer).to(half)(x.to(half))
    _o1(half)
    out, _ = layer(x)
    assert out.dtype == half
    torch.testing.assert_close(out, ref, **CHAIN_TOL[half])
    out.float().sum().backward()
    assert layer.weight_hh_l1.grad is not None
    assert layer.weight_hh_l1.grad.dtype == torch.float32
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2])
    packed_out, _ = layer(packed)
    assert packed_out.data.dtype == half
