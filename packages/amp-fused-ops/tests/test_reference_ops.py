"""The amp_C ops on the reference path, against formulas and torch.optim written here.

Expected values never come from the implementation: elementwise ops and norms are checked
against float64 formulas, the optimizers against ``torch.optim`` (single-tensor,
``foreach=False``) or a float64 formula of Apex's kernel where torch has no equivalent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from _op_cases import noop_flag as _flag
from amp_fused_ops import MultiTensorApply, amp_C, extensions

SIZES = [1, 7, 555, 33333, 2048 * 32 + 1, 2 * 2048 * 32]
CHUNKS = [333, 2048 * 32]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance of one rounding to each storage dtype (for float16 and bfloat16,
# torch.testing.assert_close's default).
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


@pytest.fixture(autouse=True)
def _reference_path() -> Iterator[None]:
    """Run amp_C's ops through the reference, whatever extensions are loaded."""
    with extensions.use_reference():
        yield


def _randn(
    dtype: torch.dtype = torch.float32, seed: int = 0, sizes: list[int] = SIZES
) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


def _close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=RTOL[dtype], atol=ATOL[dtype]
    )


def _clones(tensors: list[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


# --- scale -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("in_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_scale(chunk_size: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    ins = _randn(in_dtype)
    outs = [torch.empty_like(x, dtype=out_dtype) for x in ins]
    flag = _flag()
    MultiTensorApply(chunk_size)(amp_C.multi_tensor_scale, flag, [ins, outs], 0.125)
    for x, out in zip(ins, outs, strict=True):
        assert out.dtype == out_dtype
        _close(out, x.double() * 0.125, out_dtype)
    assert flag.item() == 0


def test_scale_in_place_and_across_shapes() -> None:
    xs = [torch.arange(16.0).reshape(4, 4)]
    expected = xs[0].clone() * 3
    amp_C.multi_tensor_scale(64, _flag(), [xs, xs], 3.0)
    torch.testing.assert_close(xs[0], expected)
    flat = [torch.empty(16)]  # same numel, other shape: row-major order
    amp_C.multi_tensor_scale(64, _flag(), [xs, flat], 0.5)
    torch.testing.assert_close(flat[0], expected.reshape(16) * 0.5)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scale_flags_nonfinite_and_still_writes(bad: float, dtype: torch.dtype) -> None:
    ins = _randn(dtype, sizes=[7, 555, 33333])
    ins[1][100] = bad
    outs = [torch.zeros(x.shape) for x in ins]
    flag = _flag()
    amp_C.multi_tensor_scale(333, flag, [ins, outs], 2.0)
    assert flag.item() == 1
    _close(outs[2], ins[2].double() * 2, torch.float32)
    assert not torch.isfinite(outs[1][100])


# --- axpby -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float16, torch.float32, torch.float32),
        (torch.float32, torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16, torch.bfloat16),
    ],
)
def test_axpby(chunk_size: int, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]) -> None:
    xs, ys = _randn(dtypes[0], seed=1), _randn(dtypes[1], seed=2)
    outs = [torch.empty_like(x, dtype=dtypes[2]) for x in xs]
    flag = _flag()
    MultiTensorApply(chunk_size)(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, -1)
    for x, y, out in zip(xs, ys, outs, strict=True):
        _close(out, 2.0 * x.double() - 0.5 * y.double(), dtypes[2])
    assert flag.item() == 0


@pytest.mark.parametrize(
    ("bad_arg", "arg_to_check", "flagged"),
    [(0, -1, 1), (1, -1, 1), (0, 0, 1), (1, 0, 0), (0, 1, 0), (1, 1, 1)],
)
def test_axpby_checks_only_the_requested_argument(
    bad_arg: int, arg_to_check: int, flagged: int
) -> None:
    xs, ys = _randn(seed=1, sizes=[555]), _randn(seed=2, sizes=[555])
    [xs, ys][bad_arg][0][5] = float("nan")
    outs = [torch.empty(555)]
    flag = _flag()
    amp_C.multi_tensor_axpby(333, flag, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert flag.item() == flagged
    assert torch.isnan(outs[0][5])


# --- l2norm / unscale_l2norm -----------------------------------------------------------------


def _norms64(xs: list[Tensor], factor: float = 1.0) -> tuple[Tensor, Tensor]:
    per = torch.stack([torch.linalg.vector_norm(x.double() * factor) for x in xs])
    return torch.linalg.vector_norm(per).reshape(1), per


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm(chunk_size: int, dtype: torch.dtype, per_tensor: bool) -> None:
    xs = _randn(dtype, seed=3)
    flag = _flag()
    total, per = MultiTensorApply(chunk_size)(amp_C.multi_tensor_l2norm, flag, [xs], per_tensor)
    expected_total, expected_per = _norms64(xs)
    assert total.dtype == per.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total.double(), expected_total, rtol=1e-5, atol=0)
    if per_tensor:
        torch.testing.assert_close(per.double(), expected_per, rtol=1e-5, atol=0)
    else:
        assert per.numel() == 0
    assert flag.item() == 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_l2norm_leaves_inputs_alone(dtype: torch.dtype) -> None:
    xs = _randn(dtype, seed=4, sizes=[7, 33333, 2048 * 32 + 1])
    before = _clones(xs)
    inv_scale = torch.tensor([1.0 / 1024])
    total, per = amp_C.multi_tensor_unscale_l2norm(333, _flag(), [xs], inv_scale, True)
    expected_total, expected_per = _norms64(xs, 1.0 / 1024)
    torch.testing.assert_close(total.double(), expected_total, rtol=1e-5, atol=0)
    torch.testing.assert_close(per.double(), expected_per, rtol=1e-5, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(xs, before, strict=True))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_l2norm_flags_nonfinite(bad: float) -> None:
    xs = _randn(torch.float16, sizes=[7, 555])
    xs[1][3] = bad
    flag = _flag()
    total, per = amp_C.multi_tensor_l2norm(333, flag, [xs], True)
    assert flag.item() == 1 and not torch.isfinite(total).any() and torch.isfinite(per[0])


def test_l2norm_of_no_tensors_is_zero() -> None:
    total, per = amp_C.multi_tensor_l2norm(333, _flag(), [[]], True)
    assert total.tolist() == [0.0] and per.numel() == 0


# --- Adam ------------------------------------------------------------------------------------

ADAM_SIZES = [1, 7, 555, 33333, 2048 * 32 + 1]


def _adam_state(dtype: torch.dtype, sizes: list[int] = ADAM_SIZES) -> list[list[Tensor]]:
    params = _randn(dtype, seed=10, sizes=sizes)
    return [params, [torch.zeros(p.shape) for p in params], [torch.zeros(p.shape) for p in params]]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_matches_torch_optim(chunk_size: int, adamw: bool, weight_decay: float) -> None:
    params, exp_avgs, exp_avg_sqs = _adam_state(torch.float32)
    ref_params = [p.clone().requires_grad_() for p in params]
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": weight_decay}
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = optim_cls(ref_params, foreach=False, fused=False, **kwargs)  # type: ignore[arg-type]
    applier = MultiTensorApply(chunk_size)
    for step in range(1, 5):
        grads = _randn(seed=100 + step, sizes=ADAM_SIZES)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        applier(
            amp_C.multi_tensor_adam,
            _flag(),
            [grads, params, exp_avgs, exp_avg_sqs],
            1e-2,
            0.9,
            0.99,
            1e-8,
            step,
            int(adamw),
            1,
            weight_decay,
        )
    for p, r in zip(params, ref_params, strict=True):
        assert (p - r.detach()).abs().max() <= 1e-5
    for m, r in zip(exp_avgs, ref_params, strict=True):
        torch.testing.assert_close(m, ref.state[r]["exp_avg"], rtol=1e-5, atol=1e-6)


def _adam_formula64(
    g: Tensor, p: Tensor, m: Tensor, v: Tensor, step: int, mode: int, bias_correction: int
) -> tuple[Tensor, Tensor, Tensor]:
    lr, b1, b2, eps, wd = 1e-3, 0.8, 0.9, 1e-6, 0.1
    g, p, m, v = g.double(), p.double(), m.double(), v.double()
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    update = (m / bc1) / ((v / bc2).sqrt() + eps) + (wd * p if mode == 1 else 0.0)
    return p - lr * update, m, v


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_adam_low_precision_params_fp32_state(
    dtype: torch.dtype, mode: int, bias_correction: int
) -> None:
    sizes = [7, 33333]
    params = _randn(dtype, seed=11, sizes=sizes)
    grads = _randn(dtype, seed=12, sizes=sizes)
    exp_avgs = [torch.rand(n) for n in sizes]
    exp_avg_sqs = [torch.rand(n) for n in sizes]
    expected = [
        _adam_formula64(*args, step=3, mode=mode, bias_correction=bias_correction)
        for args in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True)
    ]
    lists = [grads, params, exp_avgs, exp_avg_sqs]
    amp_C.multi_tensor_adam(
        333, _flag(), lists, 1e-3, 0.8, 0.9, 1e-6, 3, mode, bias_correction, 0.1
    )
    for i, (p, m, v) in enumerate(expected):
        assert params[i].dtype == dtype
        _close(params[i], p, dtype)
        _close(exp_avgs[i], m, torch.float32)
        _close(exp_avg_sqs[i], v, torch.float32)


def test_adam_propagates_nan_and_ignores_flag() -> None:
    params, exp_avgs, exp_avg_sqs = _adam_state(torch.float32, sizes=[555])
    grads = _randn(seed=13, sizes=[555])
    grads[0][9] = float("nan")
    flag = _flag()
    amp_C.multi_tensor_adam(
        333, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0
    )
    assert torch.isnan(params[0][9]) and torch.isfinite(params[0][:9]).all()
    assert flag.item() == 0  # Apex's Adam neither reads nor sets the flag


# --- Adam, capturable with master weights ----------------------------------------------------


def _master_setup(
    dtype: torch.dtype,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    masters = _randn(torch.float32, seed=20, sizes=ADAM_SIZES)
    params = [m.to(dtype) for m in masters]
    exp_avgs = [torch.zeros(m.shape) for m in masters]
    exp_avg_sqs = [torch.zeros(m.shape) for m in masters]
    return params, masters, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adamw", [False, True])
def test_adam_capturable_master_matches_torch_optim(
    chunk_size: int, dtype: torch.dtype, adamw: bool
) -> None:
    params, masters, exp_avgs, exp_avg_sqs = _master_setup(dtype)
    ref_params = [m.clone().requires_grad_() for m in masters]
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = optim_cls(
        ref_params,
        lr=1e-2,
        betas=(0.9, 0.99),
        eps=1e-8,
        weight_decay=0.01,
        foreach=False,
        fused=False,
    )
    lr, step = torch.tensor([1e-2]), torch.zeros(1, dtype=torch.int32)
    inv_scale = torch.tensor([1.0 / 256])
    applier = MultiTensorApply(chunk_size)
    for i in range(3):
        unscaled = _randn(seed=200 + i, sizes=ADAM_SIZES)
        grads = [(g * 256).to(dtype) for g in unscaled]
        grads_before = _clones(grads)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.float() / 256
        ref.step()
        step += 1
        lists = [grads, params, exp_avgs, exp_avg_sqs, masters]
        applier(
            amp_C.multi_tensor_adam_capturable_master,
            _flag(),
            lists,
            lr,
            0.9,
            0.99,
            1e-8,
            step,
            int(adamw),
            1,
            0.01,
            inv_scale,
        )
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_before, strict=True))
    for p, m, r in zip(params, masters, ref_params, strict=True):
        assert (m - r.detach()).abs().max() <= 1e-5
        assert torch.equal(p, m.to(dtype))


@pytest.mark.parametrize("cause", ["flag_on_entry", "inf", "nan"])
def test_adam_capturable_master_writes_nothing_on_overflow(cause: str) -> None:
    params, masters, exp_avgs, exp_avg_sqs = _master_setup(torch.float16)
    exp_avgs = [torch.rand(m.shape) for m in masters]
    grads = [g.half() for g in _randn(seed=30, sizes=ADAM_SIZES)]
    if cause != "flag_on_entry":
        grads[3][17] = float(cause)
    lists = [grads, params, exp_avgs, exp_avg_sqs, masters]
    before = [_clones(t) for t in lists]
    flag = _flag(1 if cause == "flag_on_entry" else 0)
    amp_C.multi_tensor_adam_capturable_master(
        333,
        flag,
        lists,
        torch.tensor([0.1]),
        0.9,
        0.999,
        1e-8,
        torch.ones(1, dtype=torch.int32),
        1,
        1,
        0.0,
        torch.ones(1),
    )
    assert flag.item() == 1
    for now, then in zip(lists, before, strict=True):
        for a, b in zip(now, then, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# --- SGD -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "weight_decay"),
    [
        (0.0, 0.0, False, 0.0),
        (0.9, 0.0, False, 1e-2),
        (0.9, 0.1, False, 0.0),
        (0.9, 0.0, True, 1e-2),
    ],
)
def test_sgd_matches_torch_optim(
    chunk_size: int, momentum: float, dampening: float, nesterov: bool, weight_decay: float
) -> None:
    params = _randn(seed=40)
    bufs = [torch.zeros(p.shape) for p in params]
    ref_params = [p.clone().requires_grad_() for p in params]
    ref = torch.optim.SGD(
        ref_params,
        lr=0.1,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        foreach=False,
    )
    applier = MultiTensorApply(chunk_size)
    for step in range(3):
        grads = _randn(seed=400 + step)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        applier(
            amp_C.multi_tensor_sgd,
            _flag(),
            [grads, params, bufs],
            weight_decay,
            momentum,
            dampening,
            0.1,
            nesterov,
            step == 0,
            False,
            1.0,
        )
    for p, r in zip(params, ref_params, strict=True):
        assert (p - r.detach()).abs().max() <= 1e-5
    if momentum == 0.0:
        assert all(not b.any() for b in bufs)  # buffers untouched


@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_sgd_scaled_half_grads_wd_after_momentum_and_model_copy(copy_dtype: torch.dtype) -> None:
    sizes = [7, 2048 * 32 + 1]
    params = _randn(seed=41, sizes=sizes)
    bufs = [torch.rand(n) for n in sizes]
    grads = [(g * 128).half() for g in _randn(seed=42, sizes=sizes)]
    copies = [torch.empty(n, dtype=copy_dtype) for n in sizes]
    wd, mom, damp, lr = 1e-2, 0.9, 0.2, 0.05
    expected = []
    for g, p, b in zip(grads, params, bufs, strict=True):
        g64, p64 = g.double() / 128, p.double()
        b64 = mom * b.double() + (1 - damp) * g64
        expected.append((p64 - lr * (b64 + wd * p64), b64))
    lists = [grads, params, bufs, copies]
    amp_C.multi_tensor_sgd(333, _flag(), lists, wd, mom, damp, lr, False, False, True, 1 / 128)
    for p, b, c, (p64, b64) in zip(params, bufs, copies, expected, strict=True):
        _close(p, p64, torch.float32)
        _close(b, b64, torch.float32)
        assert torch.equal(c, p.to(copy_dtype))


def test_sgd_skips_everything_when_flag_set() -> None:
    params, grads = _randn(seed=43, sizes=[555]), _randn(seed=44, sizes=[555])
    bufs, copies = [torch.rand(555)], [torch.zeros(555, dtype=torch.half)]
    lists = [grads, params, bufs, copies]
    before = [_clones(t) for t in lists]
    flag = _flag(1)
    amp_C.multi_tensor_sgd(333, flag, lists, 0.1, 0.9, 0.0, 0.1, True, False, False, 1.0)
    assert flag.item() == 1
    for now, then in zip(lists, before, strict=True):
        assert torch.equal(now[0], then[0])


# --- Adagrad ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_matches_torch_optim(chunk_size: int, weight_decay: float) -> None:
    params = _randn(seed=50, sizes=ADAM_SIZES)
    sums = [torch.zeros(p.shape) for p in params]
    ref_params = [p.clone().requires_grad_() for p in params]
    ref = torch.optim.Adagrad(
        ref_params, lr=0.05, eps=1e-10, weight_decay=weight_decay, foreach=False
    )
    for step in range(3):
        grads = _randn(seed=500 + step, sizes=ADAM_SIZES)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        MultiTensorApply(chunk_size)(
            amp_C.multi_tensor_adagrad, _flag(), [grads, params, sums], 0.05, 1e-10, 0, weight_decay
        )
    for p, r in zip(params, ref_params, strict=True):
        assert (p - r.detach()).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", FLOATS)
def test_adagrad_decoupled_weight_decay(dtype: torch.dtype) -> None:
    params, grads = _randn(dtype, seed=51, sizes=[555]), _randn(dtype, seed=52, sizes=[555])
    sums = [torch.rand(555).to(dtype)]
    p64, g64, h64 = params[0].double(), grads[0].double(), sums[0].double()
    h_new = h64 + g64 * g64
    p_new = p64 - 0.05 * (g64 / (h_new.sqrt() + 1e-8) + 0.1 * p64)
    amp_C.multi_tensor_adagrad(333, _flag(), [grads, params, sums], 0.05, 1e-8, 1, 0.1)
    _close(params[0], p_new, dtype)
    _close(sums[0], h_new, dtype)


# --- layouts ---------------------------------------------------------------------------------


def _channels_last(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, 5, 7, generator=gen).to(memory_format=torch.channels_last)


def _is_channels_last(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def test_channels_last_scale_and_axpby() -> None:
    x, y = _channels_last(60), _channels_last(61).contiguous()
    out = torch.empty_like(x)  # channels-last
    amp_C.multi_tensor_axpby(333, _flag(), [[x], [y], [out]], 2.0, 3.0, -1)
    assert _is_channels_last(out)
    torch.testing.assert_close(out, 2 * x + 3 * y)
    scaled = torch.empty(x.shape)  # contiguous output of a channels-last input
    amp_C.multi_tensor_scale(333, _flag(), [[x], [scaled]], 0.5)
    assert scaled.is_contiguous()
    torch.testing.assert_close(scaled, x * 0.5)


def test_channels_last_optimizers_keep_layout() -> None:
    p, g = _channels_last(62), _channels_last(63)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ref = p.clone().contiguous().requires_grad_()
    ref.grad = g.contiguous()
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False).step()
    amp_C.multi_tensor_adam(
        333, _flag(), [[g], [p], [m], [v]], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.1
    )
    assert _is_channels_last(p) and _is_channels_last(m) and _is_channels_last(v)
    assert (p - ref.detach()).abs().max() <= 1e-5
    buf = torch.zeros_like(p)
    amp_C.multi_tensor_sgd(
        333, _flag(), [[g], [p], [buf]], 0.0, 0.9, 0.0, 0.1, False, True, False, 1.0
    )
    assert _is_channels_last(p) and torch.equal(buf, g)


# --- preconditions ---------------------------------------------------------------------------

Case = Callable[[], object]


def _scale_call(**overrides: object) -> Case:
    args: dict[str, Any] = {
        "chunk_size": 333,
        "noop_flag": _flag(),
        "tensor_lists": [[torch.ones(3)], [torch.empty(3)]],
    }
    args.update(overrides)
    return lambda: amp_C.multi_tensor_scale(
        args["chunk_size"], args["noop_flag"], args["tensor_lists"], 1.0
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            _scale_call(chunk_size=0),
            ValueError,
            r"multi_tensor_scale: chunk_size must be an int in \[1, 2\*\*30\], got 0",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3)]]),
            ValueError,
            r"multi_tensor_scale: expected 2 tensor lists, got 1$",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3)], []]),
            ValueError,
            r"tensor_lists\[1\] has 0 tensors but tensor_lists\[0\] has 1",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3)], [torch.empty(4)]]),
            ValueError,
            r"tensor_lists\[1\]\[0\] has 4 elements but tensor_lists\[0\]\[0\] has 3",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3)], [torch.empty(3, device="meta")]]),
            RuntimeError,
            r"tensor_lists\[1\]\[0\] is on meta but noop_flag is on cpu",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3, dtype=torch.int64)], [torch.empty(3)]]),
            ValueError,
            r"tensor_lists\[0\]\[0\] has dtype torch.int64; "
            r"this list accepts float32, float16, bfloat16",
        ),
        (
            _scale_call(tensor_lists=[[torch.ones(3)], [3.0]]),
            TypeError,
            r"tensor_lists\[1\]\[0\] must be a tensor, got float",
        ),
        (
            _scale_call(noop_flag=torch.zeros(1)),
            ValueError,
            r"noop_flag must be a one-element int32 tensor, got dtype torch.float32",
        ),
        (_scale_call(noop_flag=torch.zeros(2, dtype=torch.int32)), ValueError, r"with 2 elements"),
        (
            _scale_call(noop_flag=torch.zeros(1, dtype=torch.int32, device="meta")),
            RuntimeError,
            r"tensor_lists\[0\]\[0\] is on cpu but noop_flag is on meta",
        ),
        (_scale_call(noop_flag=0), TypeError, r"noop_flag must be a tensor, got int"),
        (
            _scale_call(tensor_lists=[[torch.ones(3), torch.ones(3).half()], [torch.empty(3)] * 2]),
            ValueError,
            r"^multi_tensor_scale: tensor_lists\[0\]\[1\] has dtype torch.float16 but "
            r"tensor_lists\[0\]\[0\] has dtype torch.float32; the tensors of one list must "
            r"share one dtype \(group them by dtype\)$",
        ),
    ],
)
def test_scale_preconditions(call: Case, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_op_specific_preconditions() -> None:
    one, flag = [torch.ones(3)], _flag()
    with pytest.raises(
        ValueError, match=r"multi_tensor_axpby: arg_to_check must be one of \[-1, 0, 1\], got 2"
    ):
        amp_C.multi_tensor_axpby(333, flag, [one, one, one], 1.0, 1.0, 2)
    with pytest.raises(ValueError, match=r"multi_tensor_adam: mode must be one of \[0, 1\], got 2"):
        amp_C.multi_tensor_adam(333, flag, [one] * 4, 1e-3, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match=r"multi_tensor_adagrad: mode must be one of \[0, 1\]"):
        amp_C.multi_tensor_adagrad(333, flag, [one] * 3, 1e-3, 1e-8, 5, 0.0)
    with pytest.raises(ValueError, match=r"multi_tensor_sgd: expected 3 or 4 tensor lists"):
        amp_C.multi_tensor_sgd(333, flag, [one] * 2, 0.0, 0.0, 0.0, 0.1, False, True, False, 1.0)
    half = [torch.ones(3, dtype=torch.half)]
    with pytest.raises(
        ValueError,
        match=r"tensor_lists\[4\]\[0\] has dtype torch.float16; this list accepts float32",
    ):
        amp_C.multi_tensor_adam_capturable_master(
            333,
            flag,
            [half, half, one, one, half],
            torch.ones(1),
            0.9,
            0.999,
            1e-8,
            torch.ones(1),
            1,
            1,
            0.0,
            torch.ones(1),
        )


def test_empty_lists_are_a_no_op() -> None:
    flag = _flag()
    amp_C.multi_tensor_scale(333, flag, [[], []], 2.0)
    amp_C.multi_tensor_adam(333, flag, [[], [], [], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert flag.item() == 0
