"""The C++ CPU multi-tensor kernels against formulas written here and torch.optim.

The extension is compiled once per session (see ``_cpu_extension_helpers``). Each test runs
one call over a list of tensors of every size in ``SIZES``, so chunking across tensor and
chunk boundaries is exercised with both chunk sizes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _op_cases import ONE_ROUNDING
from _op_cases import noop_flag as flag

SIZES = (1, 7, 555, 33333, 2048 * 32 + 1)
CHUNK_SIZES = (333, 2048 * 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tolerances of a result stored in each dtype (fp32: math in fp32 on both sides).
TOL = ONE_ROUNDING


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def randn_list(dtype: torch.dtype, seed: int, sizes: tuple[int, ...] = SIZES) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator).to(dtype) for n in sizes]


# --- multi_tensor_scale -------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_scale_matches_formula(
    ext: Any, in_dtype: torch.dtype, out_dtype: torch.dtype, chunk_size: int
) -> None:
    ins = randn_list(in_dtype, seed=0)
    outs = [torch.empty(t.shape, dtype=out_dtype) for t in ins]
    noop = flag()
    ext.multi_tensor_scale(chunk_size, noop, [ins, outs], 0.125)
    for x, out in zip(ins, outs, strict=True):
        torch.testing.assert_close(out, (x.float() * 0.125).to(out_dtype), **TOL[out_dtype])
    assert noop.item() == 0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_scale_flags_nonfinite_input(ext: Any, bad: float, chunk_size: int) -> None:
    ins = randn_list(torch.float16, seed=1)
    ins[-1][-1] = bad  # last chunk of the last tensor
    outs = [torch.empty_like(t, dtype=torch.float32) for t in ins]
    noop = flag()
    ext.multi_tensor_scale(chunk_size, noop, [ins, outs], 2.0)
    assert noop.item() == 1
    torch.testing.assert_close(outs[0], ins[0].float() * 2.0)  # still written, as Apex


def test_scale_in_place_keeps_set_flag(ext: Any) -> None:
    xs = randn_list(torch.float32, seed=2)
    expected = [x * 0.5 for x in xs]
    noop = flag(1)
    ext.multi_tensor_scale(2048, noop, [xs, xs], 0.5)
    for x, want in zip(xs, expected, strict=True):
        torch.testing.assert_close(x, want)
    assert noop.item() == 1  # the kernel only ever sets the flag


def test_scale_channels_last(ext: Any) -> None:
    x = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    out = torch.empty_like(x)  # channels-last too
    assert not x.is_contiguous()
    ext.multi_tensor_scale(64, flag(), [[x], [out]], 3.0)
    torch.testing.assert_close(out, x * 3.0)
    assert out.is_contiguous(memory_format=torch.channels_last)


# --- multi_tensor_axpby -------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize(
    ("x_dtype", "y_dtype", "out_dtype"),
    [*((d, d, d) for d in DTYPES), (torch.float16, torch.float32, torch.bfloat16)],
)
def test_axpby_matches_formula(
    ext: Any, x_dtype: torch.dtype, y_dtype: torch.dtype, out_dtype: torch.dtype, chunk_size: int
) -> None:
    xs = randn_list(x_dtype, seed=3)
    ys = randn_list(y_dtype, seed=4)
    outs = [torch.empty(x.shape, dtype=out_dtype) for x in xs]
    noop = flag()
    ext.multi_tensor_axpby(chunk_size, noop, [xs, ys, outs], 2.0, -0.5, -1)
    for x, y, out in zip(xs, ys, outs, strict=True):
        want = (2.0 * x.float() - 0.5 * y.float()).to(out_dtype)
        torch.testing.assert_close(out, want, **TOL[out_dtype])
    assert noop.item() == 0


@pytest.mark.parametrize(
    ("bad_arg", "arg_to_check", "flagged"),
    [(0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 1, 1), (0, -1, 1), (1, -1, 1)],
)
def test_axpby_checks_the_chosen_argument(
    ext: Any, bad_arg: int, arg_to_check: int, flagged: int
) -> None:
    xs, ys = randn_list(torch.float32, seed=5), randn_list(torch.float32, seed=6)
    (xs, ys)[bad_arg][2][100] = math.inf
    outs = [torch.empty_like(x) for x in xs]
    noop = flag()
    ext.multi_tensor_axpby(333, noop, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert noop.item() == flagged


# --- multi_tensor_l2norm ------------------------------------------------------------------


@pytest.mark.parametrize("per_tensor", [True, False])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_formula(
    ext: Any, dtype: torch.dtype, chunk_size: int, per_tensor: bool
) -> None:
    xs = randn_list(dtype, seed=7)
    noop = flag()
    total, norms = ext.multi_tensor_l2norm(chunk_size, noop, [xs], per_tensor)
    squares = [x.double().pow(2).sum() for x in xs]  # exact enough: float64 oracle
    want_total = torch.stack(squares).sum().sqrt().float().reshape(1)
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total, want_total, rtol=1e-5, atol=0)
    if per_tensor:
        want = torch.stack(squares).sqrt().float()
        assert norms.dtype == torch.float32
        torch.testing.assert_close(norms, want, rtol=1e-5, atol=0)
    else:
        assert norms.numel() == 0
    assert noop.item() == 0


def test_l2norm_empty_list_and_nan(ext: Any) -> None:
    total, norms = ext.multi_tensor_l2norm(333, flag(), [[]], True)
    assert total.tolist() == [0.0] and norms.shape == (0,)
    xs = randn_list(torch.bfloat16, seed=8)
    xs[4][40000] = math.nan
    noop = flag()
    total, _ = ext.multi_tensor_l2norm(333, noop, [xs])  # per_tensor defaults to False
    assert noop.item() == 1 and math.isnan(total.item())


# --- multi_tensor_adam --------------------------------------------------------------------


def adam_formula(
    grad: Tensor, p: Tensor, m: Tensor, v: Tensor, step: int, *, lr: float, beta1: float,
    beta2: float, eps: float, wd: float, decoupled: bool, bias_correction: bool = True,
) -> None:  # fmt: skip
    """One Adam/AdamW step written out (fp32 math), updating p (any dtype), m, v in place."""
    g, p32 = grad.float(), p.float()
    if decoupled:
        p32 = p32 * (1 - lr * wd)
    else:
        g = g + wd * p32
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    p.copy_(p32 - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps))


HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.05}


def adam_call(ext: Any, chunk: int, noop: Tensor, lists: list[list[Tensor]], step: int,
              decoupled: bool, bias_correction: bool = True) -> None:  # fmt: skip
    h = HYPER
    ext.multi_tensor_adam(chunk, noop, lists, h["lr"], h["beta1"], h["beta2"], h["eps"], step,
                          int(decoupled), int(bias_correction), h["wd"])  # fmt: skip


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_adam_fp32_matches_torch_optim(ext: Any, decoupled: bool, chunk_size: int) -> None:
    h = HYPER
    params = randn_list(torch.float32, seed=9)
    ref_params = [torch.nn.Parameter(p.clone()) for p in params]
    optim_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    optim = optim_class(ref_params, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                        weight_decay=h["wd"], foreach=False, fused=False)  # fmt: skip
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = randn_list(torch.float32, seed=100 + step)
        for ref, g in zip(ref_params, grads, strict=True):
            ref.grad = g.clone()
        optim.step()
        noop = flag()
        adam_call(ext, chunk_size, noop, [grads, params, exp_avgs, exp_avg_sqs], step, decoupled)
        assert noop.item() == 0
    for p, ref in zip(params, ref_params, strict=True):
        assert (p - ref.detach()).abs().max().item() <= 1e-5
    for m, ref in zip(exp_avgs, ref_params, strict=True):
        torch.testing.assert_close(m, optim.state[ref]["exp_avg"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype"),
    [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
)  # fmt: skip
def test_adam_low_precision_matches_formula(
    ext: Any, grad_dtype: torch.dtype, param_dtype: torch.dtype, decoupled: bool
) -> None:
    params = randn_list(param_dtype, seed=10)
    ref_params = [p.clone() for p in params]
    state = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(4)]
    for step in range(1, 6):
        grads = randn_list(grad_dtype, seed=200 + step)
        adam_call(ext, 333, flag(), [grads, params, state[0], state[1]], step, decoupled)
        for i, g in enumerate(grads):
            adam_formula(g, ref_params[i], state[2][i], state[3][i], step, **HYPER,
                         decoupled=decoupled)  # fmt: skip
    # A rounding tie broken the other way in one step moves an element by one ulp, and later
    # steps carry that on: allow one ulp at the parameters' scale (randn, about 1); fp32 has
    # the 1e-5 bound of the torch.optim comparison (the formulas round differently).
    atol = max(torch.finfo(param_dtype).eps, 1e-5)
    tol = {"rtol": TOL[param_dtype]["rtol"], "atol": atol}
    for p, ref in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, ref, **tol)
    # The moments see that ulp through the L2 term (wd * p) of the gradient.
    state_atol = HYPER["wd"] * torch.finfo(param_dtype).eps + 1e-6
    for ours, ref in zip(state[0] + state[1], state[2] + state[3], strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=state_atol)


def test_adam_without_bias_correction(ext: Any) -> None:
    params = randn_list(torch.float32, seed=11, sizes=(555, 7))
    ref = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    m_ref, v_ref = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in (1, 2):
        grads = randn_list(torch.float32, seed=300 + step, sizes=(555, 7))
        adam_call(ext, 333, flag(), [grads, params, m, v], step, False, bias_correction=False)
        for i, g in enumerate(grads):
            adam_formula(g, ref[i], m_ref[i], v_ref[i], step, **HYPER, decoupled=False,
                         bias_correction=False)  # fmt: skip
    for p, want in zip(params, ref, strict=True):
        torch.testing.assert_close(p, want)


def test_adam_ignores_the_noop_flag_as_apex(ext: Any) -> None:
    """Apex's Adam kernel neither reads nor sets the flag: a set flag changes nothing."""

    def run(flag_value: int) -> tuple[list[list[Tensor]], Tensor]:
        params = randn_list(torch.bfloat16, seed=12)
        lists = [randn_list(torch.bfloat16, seed=13), params,
                 [torch.ones_like(p, dtype=torch.float32) for p in params],
                 [torch.ones_like(p, dtype=torch.float32) for p in params]]  # fmt: skip
        noop = flag(flag_value)
        adam_call(ext, 333, noop, lists, 1, True)
        return lists, noop

    with_flag, noop_after = run(1)
    without_flag, _ = run(0)
    assert int(noop_after.item()) == 1
    before = randn_list(torch.bfloat16, seed=12)
    assert not all(torch.equal(a, b) for a, b in zip(with_flag[1], before, strict=True))
    for tensors, reference in zip(with_flag, without_flag, strict=True):
        for t, r in zip(tensors, reference, strict=True):
            assert torch.equal(t, r)


def test_adam_channels_last_matches_torch_optim(ext: Any) -> None:
    h = HYPER
    param = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    ref = torch.nn.Parameter(param.clone())
    optim = torch.optim.AdamW([ref], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                              weight_decay=h["wd"], foreach=False, fused=False)  # fmt: skip
    m, v = torch.zeros_like(param), torch.zeros_like(param)  # channels-last like param
    for step in range(1, 6):
        grad = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
        ref.grad = grad.clone()
        optim.step()
        adam_call(ext, 64, flag(), [[grad], [param], [m], [v]], step, True)
    assert (param - ref.detach()).abs().max().item() <= 1e-5


# --- preconditions ------------------------------------------------------------------------


def _pair(n: int = 8) -> tuple[Tensor, Tensor]:
    return torch.randn(n), torch.empty(n)


@pytest.mark.parametrize(
    ("make_args", "match"),
    [
        (lambda: (0, flag(), [[_pair()[0]], [_pair()[1]]]), "chunk_size must be an int in"),
        (lambda: (64, torch.zeros(1), [[_pair()[0]], [_pair()[1]]]), "one-element int32 tensor"),
        (lambda: (64, flag(), [[_pair()[0]]]), "expected 2 tensor lists, got 1"),
        (lambda: (64, flag(), [[_pair()[0]], []]), "one tensor per position"),
        (lambda: (64, flag(), [[torch.randn(8)], [torch.empty(9)]]), "same number of elements"),
        (lambda: (64, flag(), [[torch.randn(4, 4)[:, ::2]], [torch.empty(8)]]),
         "is not dense in any memory format"),
        (lambda: (64, flag(), [[torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)],
                               [torch.empty(2, 3, 4, 5)]]), "different memory layouts"),
        (lambda: (64, flag(), [[torch.randn(8, dtype=torch.float64)], [torch.empty(8)]]),
         "this list accepts float32, float16, bfloat16"),
        # A tensor on another device: the dispatcher runs the kernel of that device (the
        # highest-priority device of the arguments), and Meta has none.
        (lambda: (64, flag(), [[torch.randn(8, device="meta")], [torch.empty(8)]]),
         "is on meta but noop_flag is on cpu|with Meta tensors"),
    ],
)  # fmt: skip
def test_scale_preconditions_raise(ext: Any, make_args: Any, match: str) -> None:
    # A tensor on the wrong device is a RuntimeError (as in the reference); every other
    # mistake a ValueError.
    error = RuntimeError if "is on meta" in match else ValueError
    with pytest.raises(error, match=match):
        ext.multi_tensor_scale(*make_args(), 1.0)


def test_axpby_and_adam_preconditions_raise(ext: Any) -> None:
    x, out = _pair()
    with pytest.raises(ValueError, match="arg_to_check must be -1"):
        ext.multi_tensor_axpby(64, flag(), [[x], [x], [out]], 1.0, 1.0, 2)
    g, p = torch.randn(8), torch.randn(8)
    half_state = [[g], [p], [torch.zeros(8, dtype=torch.float16)], [torch.zeros(8)]]
    with pytest.raises(ValueError, match=r"has dtype torch.float16; this list accepts float32$"):
        adam_call(ext, 64, flag(), half_state, 1, True)
    state = [[g], [p], [torch.zeros(8)], [torch.zeros(8)]]
    with pytest.raises(ValueError, match="mode must be 0"):
        ext.multi_tensor_adam(64, flag(), state, 1e-3, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ext.multi_tensor_adam(64, flag(), state, 1e-3, 0.9, 0.999, 1e-8, 0, 0, 1, 0.0)
