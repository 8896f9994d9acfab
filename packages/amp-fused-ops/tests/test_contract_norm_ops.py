"""The LayerNorm / RMSNorm ops ``norm_forward`` / ``norm_backward`` on every path, against formulas.

Each test runs the dispatcher ops on the paths of ``_op_paths.py``: the PyTorch reference, the
C++ CPU kernels (``csrc/cpu/norm_ops.cpp``) and the CUDA kernels (``csrc/cuda/layer_norm.cu``,
on a GPU or their emulated build), with the same inputs on each. Rows run from 1 to 65536
columns (on the emulated kernels up to the widest row of a full 512-thread block), with widths
that are not multiples of the vector width, and buffers that start one element off the 16-byte
grid, so the vector and the scalar loads both run.

The oracle is float64: the LayerNorm / RMSNorm formulas and their gradients written here (the
backward's from the statistics and the saved tensor it is given, as its contract says), or
PyTorch's own ``layer_norm`` / ``rms_norm`` differentiated in float64. Results are held to two
roundings of their dtype (``TOL``), the statistics to ``STATS_TOL``, and the parameter
gradients, sums over the rows, at the scale of the sum. End to end (the backward fed the
forward's own output and statistics), outputs and gradients stay within twice the error of
PyTorch's own op in the same dtype, plus the roundings that summation order and the
memory-efficient recomputation add.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from _kernel_target import EMULATED, SMALL_SIZES, OnKernelsOf
from _norm_helpers import (
    NORM_IDS,
    NORMS,
    STATS_TOL,
    ZERO_WEIGHT_CASES,
    NormSpec,
    check_zero_weight_gradients,
    max_err,
)
from _op_paths import OpPath, kernel_paths, on_device

NORM_PATHS = kernel_paths("norm_forward", "norm_backward")
EPS = 1e-5
RMS = pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
MEMORY_EFFICIENT = pytest.mark.parametrize(
    "memory_efficient", [False, True], ids=["saves_input", "saves_output"]
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {  # two roundings of the dtype
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2 * 2.0**-10, "atol": 1e-4},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
}
# (input dtype, parameter dtype or None for no parameters, mixed: output in the parameters' dtype)
DTYPE_MIXES = [
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, torch.float32, False),
    (torch.bfloat16, torch.float32, False),
    (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.float32, True),
    (torch.float32, torch.float32, True),
    (torch.float16, None, False),
]
DTYPE_MIX_IDS = [
    f"{str(x).removeprefix('torch.')}-{str(p).removeprefix('torch.')}{'-mixed' if m else ''}"
    for x, p, m in DTYPE_MIXES
]

# The widest emulated row: 512 threads per row (threads_for in csrc/cuda/layer_norm.cu) either
# way, 1031 columns a quarter of the emulated work of 4099.
_EMULATED_HIDDEN = (1, 7, 555, 1024, 1031 if SMALL_SIZES else 4099)
_HIDDEN = (1, 7, 127, 555, 1024, 1025, 4099, 8192, 65536)


def _hidden_sizes(path: OpPath) -> tuple[int, ...]:
    """The row widths a test of ``path`` runs over."""
    return _EMULATED_HIDDEN if path.name == "cuda" and EMULATED else _HIDDEN


def _rows(path: OpPath, hidden: int) -> int:
    """The rows of a test input ``hidden`` wide: few on the emulated kernels, few of the widest."""
    if path.name == "cuda" and EMULATED:
        return 5
    return 3 if hidden >= 8192 else 37


Ops = tuple[Callable[..., Any], Callable[..., Any]]


def _ops(path: OpPath) -> Ops:
    """``norm_forward`` and ``norm_backward`` of ``path`` (on "cpu": the CPU extension's)."""
    if path.name == "cpu":
        for name in ("norm_forward", "norm_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"amp_fused_ops::{name}", "CPU")
    return path.kernel_op("norm_forward"), path.kernel_op("norm_backward")


def _placed(t: Tensor, device: str, misaligned: bool) -> Tensor:
    """A copy of ``t`` on ``device`` in a buffer one element longer: at its start, or one
    element in (off the 16-byte grid of vector loads)."""
    buffer = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=device)
    view = (buffer[1:] if misaligned else buffer[:-1]).view(t.shape)
    view.copy_(t)
    return view


def _out_dtype(x: Tensor, weight: Tensor | None, mixed: bool) -> torch.dtype:
    return weight.dtype if mixed and weight is not None else x.dtype


def _forward64(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, rms: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, invvar)`` in float64: ``xhat = (x - mean) * invvar`` with
    ``invvar = 1 / sqrt(var + eps)`` (RMSNorm: ``mean = 0`` and the mean square for ``var``),
    ``out = xhat * weight + bias``."""
    x64 = x.double()
    if rms:
        mean = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        centered = x64
    else:
        mean = x64.mean(dim=1)
        centered = x64 - mean[:, None]
    invvar = torch.rsqrt(centered.square().mean(dim=1) + EPS)
    out = centered * invvar[:, None]
    if weight is not None:
        out = out * weight.double()
    if bias is not None and not rms:
        out = out + bias.double()
    return out, mean, invvar


def _backward64(
    dy: Tensor,
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    rms: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` in float64 from the statistics and the saved tensor: the input,
    or with ``memory_efficient`` the output, whose ``xhat`` is ``(out - bias) / weight``.

    ``dx = invvar * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * weight`` (RMSNorm:
    without ``mean(g)``), ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``.
    """
    mean64, invvar64 = mean.double()[:, None], invvar.double()[:, None]
    if memory_efficient:
        xhat = saved.double()
        if bias is not None and not rms:
            xhat = xhat - bias.double()
        if weight is not None:
            xhat = xhat / weight.double()
    else:
        xhat = (saved.double() - (0 if rms else mean64)) * invvar64
    dy64 = dy.double()
    g = dy64 * weight.double() if weight is not None else dy64
    centered = g if rms else g - g.mean(dim=1, keepdim=True)
    dx = (centered - xhat * (g * xhat).mean(dim=1, keepdim=True)) * invvar64
    dweight = (dy64 * xhat).sum(dim=0) if weight is not None else None
    dbias = dy64.sum(dim=0) if bias is not None and not rms else None
    return dx, dweight, dbias


def _close(got: Tensor, want64: Tensor, what: str, tol: dict[str, float] | None = None) -> None:
    """``got`` within ``tol`` (``TOL`` of its dtype by default) of the float64 ``want64``."""
    tol = tol or TOL[got.dtype]
    assert got.shape == want64.shape, (what, got.shape, want64.shape)
    torch.testing.assert_close(
        got.double(), want64, **tol, msg=lambda m: f"{what} ({got.dtype}): {m}"
    )


def _sums_close(got: Tensor, want64: Tensor | None, rows: int, what: str) -> None:
    """A parameter gradient (a column sum over ``rows``): one rounding of its dtype, plus fp32
    summation in another order at the sum's scale; an empty tensor for an absent parameter."""
    if want64 is None:
        assert got.shape == (0,), (what, got.shape)
        return
    scale = max(want64.abs().max().item(), 1.0)
    atol = 1e-5 * scale * rows
    _close(got, want64, what, {"rtol": TOL[got.dtype]["rtol"], "atol": atol})


# --- the kernels against the formulas ------------------------------------------------------------


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@RMS
@pytest.mark.parametrize(("x_dtype", "p_dtype", "mixed"), DTYPE_MIXES, ids=DTYPE_MIX_IDS)
@MEMORY_EFFICIENT
def test_norm_forward_and_backward_match_the_formulas_aligned_or_not(
    path: OpPath,
    rms: bool,
    x_dtype: torch.dtype,
    p_dtype: torch.dtype | None,
    mixed: bool,
    memory_efficient: bool,
) -> None:
    forward, backward = _ops(path)
    for hidden in _hidden_sizes(path):
        rows = _rows(path, hidden)
        for misaligned in (False, True):
            where = f"hidden {hidden}, {'misaligned' if misaligned else 'aligned'}"
            gen = torch.Generator().manual_seed(hidden)
            x = _placed((torch.randn(rows, hidden, generator=gen) * 3 + 1).to(x_dtype),
                        path.device, misaligned)  # fmt: skip
            weight = bias = None
            if p_dtype is not None:
                weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device, p_dtype)
                bias = None if rms else torch.randn(hidden, generator=gen).to(path.device, p_dtype)

            out, mean, invvar = forward(x, weight, bias, EPS, rms, mixed, memory_efficient)
            out64, mean64, invvar64 = _forward64(x, weight, bias, rms)
            out_dtype = _out_dtype(x, weight, mixed)
            assert out.dtype == out_dtype and mean.dtype == invvar.dtype == torch.float32
            _close(out, out64, f"out, {where}")
            _close(mean, mean64, f"mean, {where}", STATS_TOL)
            _close(invvar, invvar64, f"invvar, {where}", STATS_TOL)

            dy = _placed(torch.randn(rows, hidden, generator=gen).to(out_dtype), path.device,
                         misaligned)  # fmt: skip
            saved = _placed(out64.to(out_dtype), path.device, misaligned) if memory_efficient else x
            stats = (mean64.float(), invvar64.float())
            dx, dweight, dbias = backward(dy, saved, *stats, weight, bias, rms, memory_efficient,
                                          x_dtype)  # fmt: skip
            want = _backward64(dy, saved, *stats, weight, bias, rms, memory_efficient)
            assert dx.dtype == x_dtype
            _close(dx, want[0], f"grad of the input, {where}")
            _sums_close(dweight, want[1], rows, f"grad of the weight, {where}")
            _sums_close(dbias, want[2], rows, f"grad of the bias, {where}")
            if weight is not None:
                assert dweight.dtype == weight.dtype
            if want[2] is not None:
                assert bias is not None and dbias.dtype == bias.dtype


def _bound(dtype: torch.dtype, torch_err: float, scale: float, *, memory_efficient: bool) -> float:
    """How far from the float64 result ours may be: twice PyTorch's error, plus roundings.

    ``scale`` is the magnitude of the terms the result is made of. A float64 gradient of a
    low-precision tensor is rounded to its dtype, so a result one rounding away from it is
    still correct (two for float32, whose errors are all summation order). The
    memory-efficient backward recomputes xhat from the rounded output: one more rounding.
    """
    eps = torch.finfo(dtype).eps
    bound = 2 * torch_err + 1e-6 + (2 if dtype == torch.float32 else 1) * eps * scale
    if memory_efficient:
        bound += eps * scale
    return bound


def _scale(t: Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _input_grad_scale(x: Tensor, dy: Tensor, weight: Tensor, rms: bool) -> float:
    """The size of the terms of the input gradient, ``max |dy * weight| * max invvar``: it
    cancels to nearly nothing where a row's ``dy * weight`` is nearly constant (one column, say),
    so its rounding error is relative to the terms, not to the result."""
    x64 = x.double()
    spread = x64.square().mean(-1) if rms else x64.var(-1, unbiased=False)
    invvar = torch.rsqrt(spread + EPS).max().item()
    return (dy.double() * weight.double()).abs().max().item() * invvar


def _torch_norm(x: Tensor, weight: Tensor, bias: Tensor | None, rms: bool) -> Tensor:
    """PyTorch's own op in ``x``'s dtype (the parameters cast to it)."""
    w = weight.to(x.dtype)
    if rms:
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    return F.layer_norm(x, (x.shape[-1],), w, bias.to(x.dtype) if bias is not None else None, EPS)


def _torch_grads(x: Tensor, weight: Tensor, bias: Tensor | None, rms: bool, dy: Tensor,
                 dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """PyTorch's norm in ``dtype`` on leaves of that dtype: the output and the gradients of
    ``(out * dy).sum()`` by the input and the parameters."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, bias) if t is not None]
    out = _torch_norm(leaves[0], leaves[1], leaves[2] if len(leaves) > 2 else None, rms)
    grads = torch.autograd.grad(out, leaves, dy.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@RMS
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@MEMORY_EFFICIENT
def test_norm_stays_within_twice_torch_error_end_to_end(
    path: OpPath, rms: bool, dtype: torch.dtype, memory_efficient: bool
) -> None:
    """The backward fed the forward's own output (``memory_efficient``) or input and its own
    statistics, as the modules do: every result within twice the error of PyTorch's op."""
    forward, backward = _ops(path)
    for hidden in _hidden_sizes(path):
        gen = torch.Generator().manual_seed(hidden)
        shape = (_rows(path, hidden), hidden)
        x = (torch.randn(shape, generator=gen) * 3 + 1).to(path.device, dtype)
        dy = torch.randn(shape, generator=gen).to(path.device, dtype)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device, dtype)
        bias = None if rms else (torch.rand(hidden, generator=gen) - 0.5).to(path.device, dtype)

        out, mean, invvar = forward(x, weight, bias, EPS, rms, False, memory_efficient)
        saved = out if memory_efficient else x
        grads = backward(dy, saved, mean, invvar, weight, bias, rms, memory_efficient, dtype)
        out_t, grads_t = _torch_grads(x, weight, bias, rms, dy, dtype)
        out_64, grads_64 = _torch_grads(x, weight, bias, rms, dy, torch.float64)

        assert out.dtype == dtype
        bound = _bound(dtype, max_err(out_t, out_64), _scale(out_64), memory_efficient=False)
        assert max_err(out, out_64) <= bound, f"hidden {hidden}, out: {max_err(out, out_64)}"
        for name, g, g_t, g_64 in zip(["input", "weight", "bias"], grads, grads_t, grads_64,
                                      strict=False):  # fmt: skip
            assert g.dtype == dtype, name
            scale = _scale(g_64)
            if name == "input":
                scale = max(scale, _input_grad_scale(x, dy, weight, rms))
            bound = _bound(dtype, max_err(g_t, g_64), scale, memory_efficient=memory_efficient)
            err = max_err(g, g_64)
            assert err <= bound, f"hidden {hidden}, grad of the {name}: {err} > {bound}"


def _many_rows(path: OpPath) -> tuple[int, ...]:
    """Row counts from one row to enough row slices to fill a GPU several times over (the
    CPU paths reduce the rows in one pass: fewer suffice)."""
    if path.name != "cuda":
        return (1, 16384)
    if EMULATED:
        return (1, 100) if SMALL_SIZES else (1, 1000)
    return (1, 16384, 70001)


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@RMS
def test_many_rows_reduce_the_parameter_gradients(path: OpPath, rms: bool) -> None:
    forward, backward = _ops(path)
    hidden = 256
    gen = torch.Generator().manual_seed(5)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device)
    bias = None if rms else (torch.rand(hidden, generator=gen) - 0.5).to(path.device)
    for rows in _many_rows(path):
        x = torch.randn(rows, hidden, generator=gen).to(path.device)
        dy = torch.randn(rows, hidden, generator=gen).to(path.device)
        _, mean, invvar = forward(x, weight, bias, EPS, rms, False, False)
        _, dweight, dbias = backward(dy, x, mean, invvar, weight, bias, rms, False, torch.float32)
        _, mean64, invvar64 = _forward64(x, weight, bias, rms)
        _, dweight64, dbias64 = _backward64(dy, x, mean64, invvar64, weight, bias, rms, False)
        # fp32 sums of `rows` terms of size ~1: relative error ~ 1e-7 * sqrt(rows).
        tol = {"rtol": 1e-4, "atol": 1e-6 * rows}
        _close(dweight, dweight64, f"grad of the weight, {rows} rows", tol)
        if dbias64 is not None:
            _close(dbias, dbias64, f"grad of the bias, {rows} rows", tol)


_CPU_PATH = [p for p in NORM_PATHS if p.id == "cpu"]


@pytest.mark.parametrize("path", _CPU_PATH, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_the_cpu_backward_of_half_rows_sums_the_parameter_gradients_in_float32(
    path: OpPath, dtype: torch.dtype
) -> None:
    """Half rows with float32 parameters: the weight and bias gradients are float32 sums over
    the rows (ATen's CPU backward of such rows sums them in the input's dtype, off by tens of
    percent over a few thousand rows)."""
    forward, backward = _ops(path)
    rows, hidden = 4096, 64
    gen = torch.Generator().manual_seed(9)
    weight = torch.rand(hidden, generator=gen) + 0.5
    bias = torch.rand(hidden, generator=gen) - 0.5
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    _, mean, invvar = forward(x, weight, bias, EPS, False, False, False)
    _, dweight, dbias = backward(dy, x, mean, invvar, weight, bias, False, False, dtype)
    _, mean64, invvar64 = _forward64(x, weight, bias, False)
    _, dweight64, dbias64 = _backward64(dy, x, mean64, invvar64, weight, bias, False, False)
    tol = {"rtol": 1e-4, "atol": 1e-6 * rows}
    _close(dweight, dweight64, "grad of the weight", tol)
    _close(dbias, dbias64, "grad of the bias", tol)


@pytest.mark.parametrize("path", _CPU_PATH, indirect=True)
@pytest.mark.parametrize(
    ("rms", "memory_efficient", "dtype"),
    [
        (False, False, torch.bfloat16),
        (True, False, torch.float32),
        (False, True, torch.float16),
    ],
    ids=["layer_norm-bfloat16", "rms_norm-float32", "memory_efficient-float16"],
)
def test_the_cpu_backward_gives_the_same_bits_on_any_number_of_threads(
    path: OpPath, rms: bool, memory_efficient: bool, dtype: torch.dtype
) -> None:
    """The CPU backward cuts the rows into ranges by the shape alone and adds the ranges'
    parameter-gradient sums in order, so one thread and two give the same bits."""
    forward, backward = _ops(path)
    rows, hidden = 1000, 96
    gen = torch.Generator().manual_seed(4)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    bias = None if rms else torch.randn(hidden, generator=gen).to(dtype)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    out, mean, invvar = forward(x, weight, bias, EPS, rms, False, memory_efficient)
    saved = out if memory_efficient else x
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                backward(dy, saved, mean, invvar, weight, bias, rms, memory_efficient, dtype)
            )
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(*results, strict=True):
        torch.testing.assert_close(two, one, rtol=0, atol=0)


# --- the CUDA kernels' layouts ----------------------------------------------------------------

# (input dtype, parameter dtype, width): rows that reach each layout of the resident kernels of
# csrc/cuda/layer_norm.cu: one chunk per thread and eight rows per block (64), four chunks with
# threads left idle at the row's end (1000), the backward summing the parameter gradients
# itself at 16 elements per thread (8192 float32, 512 bfloat16) or in shared memory above
# (16384; 12288 float16: 3 chunks of 8 per thread, the fourth left idle), eight chunks per
# thread in the forward (16384 float32), and float32 parameters of a bfloat16 input (2048, and
# 16384: the memory-efficient backward's bias from float32 into shared memory).
# The emulated AddressSanitizer run takes the narrow ones.
_LAYOUT_CASES = [
    (torch.float32, torch.float32, 64),
    (torch.float32, torch.float32, 1000),
    (torch.float16, torch.float16, 1000),
    (torch.bfloat16, torch.bfloat16, 512),
    (torch.bfloat16, torch.float32, 2048),
    (torch.float32, torch.float32, 8192),
    (torch.float32, torch.float32, 16384),
    (torch.bfloat16, torch.bfloat16, 16384),
    (torch.float16, torch.float16, 12288),
    (torch.bfloat16, torch.float32, 16384),
]
if SMALL_SIZES:  # the AddressSanitizer run takes the rows up to 2048 wide
    _LAYOUT_CASES = [case for case in _LAYOUT_CASES if case[2] <= 2048]
_LAYOUT_IDS = [f"{str(x).removeprefix('torch.')}-{str(p).removeprefix('torch.')}-{h}"
               for x, p, h in _LAYOUT_CASES]  # fmt: skip


def _walking_device(path: OpPath, hidden: int) -> tuple[int, AbstractContextManager[Any]]:
    """Rows enough for every block of the CUDA kernels to walk several row groups, and the
    device to run them on: the GPU with tens of thousands of rows, or the emulated kernels on
    an emulated device of one SM (the grids are sized by the SM count), with a few dozen."""
    if EMULATED:
        from amp_fused_ops import emulation

        # at 16384: 4 forward blocks of 5 rows, 2 backward blocks of 10
        rows = 20 if hidden >= 16384 else (40 if hidden >= 8192 else 100)
        return rows, emulation.multiprocessors(1)
    return 20011, nullcontext()


@pytest.mark.parametrize("path", [p for p in NORM_PATHS if p.id == "cuda"], indirect=True)
@pytest.mark.parametrize("kernels", ["resident", "per_row"])
@RMS
@MEMORY_EFFICIENT
@pytest.mark.parametrize(("x_dtype", "p_dtype", "hidden"), _LAYOUT_CASES, ids=_LAYOUT_IDS)
def test_cuda_kernels_match_the_formulas_when_blocks_walk_the_rows(
    path: OpPath,
    kernels: str,
    rms: bool,
    memory_efficient: bool,
    x_dtype: torch.dtype,
    p_dtype: torch.dtype,
    hidden: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both sets of CUDA kernels (``AMP_FUSED_OPS_NORM_KERNELS``) with blocks that each take
    several rows: statistics and outputs per row, parameter gradients summed over the blocks."""
    monkeypatch.setenv("AMP_FUSED_OPS_NORM_KERNELS", kernels)
    forward, backward = _ops(path)
    rows, device = _walking_device(path, hidden)
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3 + 1).to(path.device, x_dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device, p_dtype)
    bias = None if rms else torch.randn(hidden, generator=gen).to(path.device, p_dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(path.device, x_dtype)
    out64, mean64, invvar64 = _forward64(x, weight, bias, rms)
    saved = out64.to(x_dtype) if memory_efficient else x
    stats = (mean64.float(), invvar64.float())
    with device:
        out, mean, invvar = forward(x, weight, bias, EPS, rms, False, memory_efficient)
        dx, dweight, dbias = backward(dy, saved, *stats, weight, bias, rms, memory_efficient,
                                      x_dtype)  # fmt: skip
    _close(out, out64, "out")
    _close(mean, mean64, "mean", STATS_TOL)
    _close(invvar, invvar64, "invvar", STATS_TOL)
    want = _backward64(dy, saved, *stats, weight, bias, rms, memory_efficient)
    _close(dx, want[0], "grad of the input")
    _sums_close(dweight, want[1], rows, "grad of the weight")
    _sums_close(dbias, want[2], rows, "grad of the bias")


@pytest.mark.parametrize("path", [p for p in NORM_PATHS if p.id == "cuda"], indirect=True)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm_without_bias", "rms_norm"])
@MEMORY_EFFICIENT
@pytest.mark.parametrize(("x_dtype", "p_dtype", "hidden"), _LAYOUT_CASES, ids=_LAYOUT_IDS)
def test_the_resident_kernels_without_a_bias_give_the_bits_of_those_for_a_bias(
    path: OpPath,
    rms: bool,
    memory_efficient: bool,
    x_dtype: torch.dtype,
    p_dtype: torch.dtype,
    hidden: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A norm without a bias (an RMSNorm, a LayerNorm with a weight only) runs the resident
    kernels compiled without the bias's registers and sums; they must give, bit for bit, what
    the kernels for a bias give with the bias left out at run time
    (``AMP_FUSED_OPS_NORM_KERNELS=resident_generic``), and the formulas' values."""
    forward, backward = _ops(path)
    rows, device = _walking_device(path, hidden)
    gen = torch.Generator().manual_seed(hidden + 1)
    x = (torch.randn(rows, hidden, generator=gen) * 3 + 1).to(path.device, x_dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device, p_dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(path.device, x_dtype)
    results = {}
    with device:
        for kernels in ("resident", "resident_generic"):
            monkeypatch.setenv("AMP_FUSED_OPS_NORM_KERNELS", kernels)
            out, mean, invvar = forward(x, weight, None, EPS, rms, False, memory_efficient)
            saved = out if memory_efficient else x
            grads = backward(dy, saved, mean, invvar, weight, None, rms, memory_efficient, x_dtype)
            results[kernels] = (out, mean, invvar, *grads)
    for name, got, want in zip(
        ("out", "mean", "invvar", "dx", "dweight", "dbias"),
        results["resident"],
        results["resident_generic"],
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    out, mean, invvar, dx, dweight, dbias = results["resident"]
    out64, mean64, invvar64 = _forward64(x, weight, None, rms)
    _close(out, out64, "out")
    _close(mean, mean64, "mean", STATS_TOL)
    _close(invvar, invvar64, "invvar", STATS_TOL)
    saved = out if memory_efficient else x
    want = _backward64(dy, saved, mean, invvar, weight, None, rms, memory_efficient)
    _close(dx, want[0], "grad of the input")
    _sums_close(dweight, want[1], rows, "grad of the weight")
    _sums_close(dbias, want[2], rows, "grad of the bias")


@pytest.mark.parametrize("path", [p for p in NORM_PATHS if p.id == "cuda"], indirect=True)
def test_an_unknown_set_of_cuda_norm_kernels_is_refused(
    path: OpPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    forward, backward = _ops(path)
    x = torch.ones(2, 64, device=path.device)
    _, mean, invvar = forward(x, None, None, EPS, False, False, False)
    monkeypatch.setenv("AMP_FUSED_OPS_NORM_KERNELS", "fastest")
    message = (
        "^AMP_FUSED_OPS_NORM_KERNELS=fastest is not one of 'resident', 'per_row', "
        "'resident_column', 'resident_generic'$"
    )
    with pytest.raises(RuntimeError, match=message):
        forward(x, None, None, EPS, False, False, False)
    with pytest.raises(RuntimeError, match=message):
        backward(x, x, mean, invvar, None, None, False, False, torch.float32)


# --- inputs the kernels do not take ---------------------------------------------------------


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@RMS
@pytest.mark.parametrize(
    ("hidden", "x_dtype", "weight_dtype", "bias_dtype", "transposed"),
    [
        pytest.param(65537, torch.float32, torch.float32, torch.float32, False, id="long_rows"),
        pytest.param(33, torch.float64, torch.float64, torch.float64, False, id="float64"),
        pytest.param(33, torch.bfloat16, torch.float32, torch.bfloat16, False, id="two_p_dtypes"),
        pytest.param(33, torch.float32, torch.bfloat16, torch.bfloat16, False, id="half_params"),
        pytest.param(16, torch.float16, torch.bfloat16, None, False, id="other_half_weight"),
        pytest.param(16, torch.float32, None, None, True, id="transposed"),
    ],
)
def test_inputs_the_kernels_do_not_take_give_the_formulas_values(
    path: OpPath,
    rms: bool,
    hidden: int,
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    transposed: bool,
) -> None:
    """Rows longer than the CUDA kernels', float64, parameters of two dtypes or of a half dtype
    beside a float32 input, and a transposed input: fp32 math, in the input's dtype (the
    parameters' dtypes for their gradients), forward and backward."""
    forward, backward = _ops(path)
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, hidden, generator=gen) * 2 + 0.5).to(path.device, x_dtype)
    if transposed:
        x = (torch.randn(hidden, 3, generator=gen) * 2 + 0.5).to(path.device, x_dtype).t()
    weight = bias = None
    if weight_dtype is not None:
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(path.device, weight_dtype)
    if bias_dtype is not None:
        bias = torch.randn(hidden, generator=gen).to(path.device, bias_dtype)
    tol = TOL.get(x_dtype, TOL[torch.float32])

    out, mean, invvar = forward(x, weight, bias, EPS, rms, False, False)
    out64, mean64, invvar64 = _forward64(x, weight, bias, rms)
    assert out.dtype == x_dtype and mean.dtype == invvar.dtype == torch.float32
    _close(out, out64, "out", tol)
    _close(mean, mean64, "mean", STATS_TOL)
    _close(invvar, invvar64, "invvar", STATS_TOL)

    dy = torch.randn(x.shape, generator=gen).to(path.device, x_dtype)
    stats = (mean64.float(), invvar64.float())
    dx, dweight, dbias = backward(dy, x, *stats, weight, bias, rms, False, x_dtype)
    want = _backward64(dy, x, *stats, weight, bias, rms, False)
    assert dx.dtype == x_dtype
    sums = {"rtol": max(tol["rtol"], 1e-4), "atol": 1e-2}
    _close(dx, want[0], "grad of the input", sums)
    for name, got, wanted, param in (("weight", dweight, want[1], weight),
                                     ("bias", dbias, want[2], bias)):  # fmt: skip
        if wanted is None:
            assert got.shape == (0,), name
        else:
            assert param is not None and got.dtype == param.dtype, name
            own = TOL.get(got.dtype, TOL[torch.float32])
            _close(got, wanted, f"grad of the {name}", {**sums, "rtol": max(own["rtol"], 1e-4)})


def test_the_python_aten_fallback_matches_the_formulas_for_each_dtype() -> None:
    """Without a compiled kernel a CPU LayerNorm runs ATen's fused kernels (fp32 parameters
    and math for half inputs): the statistics and results are the fp32 formulas'."""
    from amp_fused_ops.reference._norm import _aten_supported, norm_backward_aten, norm_forward_aten

    gen = torch.Generator().manual_seed(3)
    rows, hidden = 33, 1000
    for dtype in DTYPES:
        for mixed in (False, True):
            x = (torch.randn(rows, hidden, generator=gen) * 3 + 1).to(dtype)
            param_dtype = torch.float32 if mixed else dtype
            w = torch.randn(hidden, generator=gen).to(param_dtype)
            b = torch.randn(hidden, generator=gen).to(param_dtype)
            assert _aten_supported(x, (w, b), rms=False)
            out, mean, invvar = norm_forward_aten(x, w, b, EPS, False, mixed)
            out64, mean64, invvar64 = _forward64(x, w, b, False)
            assert out.dtype == _out_dtype(x, w, mixed) and mean.dtype == torch.float32
            _close(mean, mean64, "mean", {"rtol": 1e-5, "atol": 1e-6})
            _close(invvar, invvar64, "invvar", {"rtol": 1e-5, "atol": 0})
            # the fp32 value rounded to its dtype, up to fp32 rounding in another order
            bound = 4 * torch.finfo(out.dtype).eps * max(1.0, out64.abs().max().item())
            assert max_err(out, out64) <= bound, (dtype, mixed, max_err(out, out64), bound)

            dy = torch.randn(rows, hidden, generator=gen).to(out.dtype)
            got = norm_backward_aten(dy, x, mean64.float(), invvar64.float(), w, b, False, False,
                                     dtype)  # fmt: skip
            want = _backward64(dy, x, mean64.float(), invvar64.float(), w, b, False, False)
            for name, g, r in zip(("dx", "dw", "db"), got, want, strict=True):
                assert r is not None and g.dtype == (dtype if name == "dx" else param_dtype)
                # dx: rounding of the result; dw, db: sums of `rows` products, rounded
                bound = 4 * torch.finfo(g.dtype).eps * max(1.0, r.abs().max().item())
                assert max_err(g, r) <= bound, (dtype, mixed, name, max_err(g, r), bound)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
def test_a_weight_of_another_width_is_refused(path: OpPath) -> None:
    forward, _ = _ops(path)
    x = torch.randn(8, 16, device=path.device)
    match = r"parameters must be contiguous of shape \(16\)" if path.name == "cuda" else None
    with pytest.raises(RuntimeError, match=match):
        forward(x, torch.ones(15, device=path.device), None, EPS, False, False, False)


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
def test_a_mixed_norm_without_weight_is_refused(path: OpPath, x_dtype: torch.dtype) -> None:
    """Every path, the inputs a CUDA kernel hands to the C++ reference (float64) too."""
    forward, _ = _ops(path)
    x = torch.randn(8, 16, device=path.device, dtype=x_dtype)
    message = "^norm_forward: the mixed-dtype variant needs a weight$"
    with pytest.raises(ValueError, match=message):
        forward(x, None, None, EPS, False, True, False)


@pytest.mark.skipif(EMULATED, reason="the emulated kernels take CPU tensors: one device")
@pytest.mark.parametrize("path", [p for p in NORM_PATHS if p.id == "cuda"], indirect=True)
def test_the_cuda_kernels_refuse_parameters_on_another_device(path: OpPath) -> None:
    forward, _ = _ops(path)
    x = torch.randn(8, 16, device=path.device)
    with pytest.raises(RuntimeError, match="parameters must be on the input's device"):
        forward(x, torch.ones(16), None, EPS, False, False, False)


# --- the modules on the path's kernels ------------------------------------------------------


class _OnCudaKernels(TorchDispatchMode):
    """Runs every ``norm_forward`` / ``norm_backward`` call on CUDA copies of its tensors,
    below autograd, and hands the results back on the CPU: the modules run their own code on
    CPU tensors and the GPU's kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "amp_fused_ops" and name in ("norm_forward", "norm_backward"):
            self.calls[name] += 1
            return on_device(func(*on_device(args, "cuda"), **(kwargs or {})), "cpu")
        return func(*args, **(kwargs or {}))


def _modules_on(path: OpPath) -> AbstractContextManager[Any]:
    """Where the modules' norm ops run for ``path``: the reference (the path's own mode), the
    CPU extension, or the CUDA kernels (the emulated build's, or the GPU's)."""
    if path.name != "cuda":
        _ops(path)
        return nullcontext()
    return OnKernelsOf("amp_fused_ops_emu") if EMULATED else _OnCudaKernels()


@pytest.mark.parametrize("path", NORM_PATHS, indirect=True)
@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize(("variant", "dtype"), ZERO_WEIGHT_CASES)
def test_memory_efficient_with_a_zero_weight_gives_exact_gradients(
    path: OpPath, spec: NormSpec, variant: str, dtype: torch.dtype
) -> None:
    """A zero weight hides the normalized input from the output: the modules and Apex's
    Functions save the input instead, and every gradient is PyTorch's in fp32."""
    with _modules_on(path) as routed:
        check_zero_weight_gradients(spec, variant, dtype)
    if routed is not None:
        assert routed.calls["norm_forward"] >= 1 and routed.calls["norm_backward"] >= 1


# --- the autograd formulas ------------------------------------------------------------------


def _formulas() -> Iterator[tuple[str, Callable[..., Any]]]:
    from amp_fused_ops.normalization import _ops as _norm_ops

    yield "C++ formula", _norm_ops.NORM_FORWARD
    yield "Python formula", _norm_ops._autograd_kernel


@pytest.mark.parametrize("path", [p for p in NORM_PATHS if p.id != "cuda"], indirect=True)
@RMS
@MEMORY_EFFICIENT
def test_the_cpp_and_python_autograd_formulas_give_the_float64_gradients(
    path: OpPath, rms: bool, memory_efficient: bool
) -> None:
    """``norm_forward`` differentiated by the C++ autograd kernel (the CPU extension's) and by
    the Python one (devices without an extension): the float64 gradients, both."""
    _ops(path)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 12, generator=gen).requires_grad_()
    w = (torch.rand(12, generator=gen) + 0.5).requires_grad_()
    b = None if rms else torch.randn(12, generator=gen).requires_grad_()
    dy = torch.randn(5, 12, generator=gen)
    b64 = None if b is None else b.detach()
    out64, mean64, invvar64 = _forward64(x.detach(), w.detach(), b64, rms)
    want = _backward64(dy, x.detach(), mean64, invvar64, w.detach(), b64, rms, False)
    for name, call in _formulas():
        out, _, _ = call(x, w, b, EPS, rms, False, memory_efficient)
        params = [t for t in (x, w, b) if t is not None]
        grads = torch.autograd.grad(out, params, dy)
        _close(out.detach(), out64, f"{name}: out")
        for what, got, wanted in zip(("input", "weight", "bias"), grads, want, strict=False):
            assert wanted is not None
            _close(got, wanted, f"{name}: grad of the {what}")
