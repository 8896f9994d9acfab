"""The SyncBN dispatcher ops on every path that implements them, against float64 batch norm.

Covers ``syncbn_welford_mean_var``, ``syncbn_welford_parallel``, ``syncbn_forward``,
``syncbn_reduce`` and ``syncbn_backward`` (``torch.ops.amp_fused_ops``): each test runs the ops
of one path of ``_op_paths.py`` (the reference on CPU tensors, or the CUDA kernels on a GPU or
their emulated build), channels-first ``(N, C, *)`` and channels-last (a contiguous ``(*, C)``),
in float32, float16 and bfloat16, and float64, which every path computes in float32 and returns
in float64.

The oracle is float64 arithmetic written here: the batch's statistics, the batch-norm formulas,
and autograd through ``F.batch_norm`` over the whole batch for a backward over simulated ranks
(a batch split unequally, one part empty; the all-reduce's sums taken by hand). Statistics and
sums are float32 whatever the input dtype; outputs are held to one rounding of their dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from _kernel_target import EMULATED
from _op_paths import OpPath, kernel_paths

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-5
SPLITS = (5, 0, 2, 9)  # batch rows per simulated rank
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
# The sums of a reduction, against the float64 sums: relative to the sum of the terms'
# magnitudes per channel (the sums cancel), as float32 accumulation in any order allows.
SUM_RTOL = 1e-5

# Shapes (N, C, *) across the kernels' vector width and block sizes, 1 to a few thousand elements
# per channel; on a GPU also its launches' larger shapes (seconds each on the emulated build).
SHAPES = ((16, 3), (4, 5, 7), (3, 6, 5, 4), (1, 1, 1), (3, 7, 5), (4, 33, 9, 9), (2, 5, 555))
GPU_SHAPES = ((2, 3), (8, 5, 33), (16, 3, 56, 56), (64, 4, 7, 7), (3, 513, 9))

WELFORD_MEAN_VAR = kernel_paths("syncbn_welford_mean_var")
WELFORD_PARALLEL = kernel_paths("syncbn_welford_parallel")
FORWARD = kernel_paths("syncbn_forward")
REDUCE = kernel_paths("syncbn_reduce")
BACKWARD = kernel_paths("syncbn_backward")
ALL_OPS = kernel_paths(
    "syncbn_welford_mean_var",
    "syncbn_welford_parallel",
    "syncbn_forward",
    "syncbn_reduce",
    "syncbn_backward",
)


def _shapes(path: OpPath) -> tuple[tuple[int, ...], ...]:
    """The shapes a test of ``path`` runs over."""
    return SHAPES + GPU_SHAPES if path.name == "cuda" and not EMULATED else SHAPES


def _batch(path: OpPath, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    """A channels-first batch on ``path``'s device, each channel around its own mean; the same
    values on every path."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.linspace(-2, 3, shape[1]).view([1, -1] + [1] * (len(shape) - 2))
    return (torch.randn(shape, generator=g) * 2 + offsets).to(device=path.device, dtype=dtype)


def _layout(x: Tensor, channel_last: bool) -> Tensor:
    """The ops' argument for a channels-first ``x``: itself, or a contiguous ``(N, *, C)``."""
    return x.movedim(1, -1).contiguous() if channel_last else x


def _channels_first(x: Tensor, channel_last: bool) -> Tensor:
    """An op's result in the layout of its argument, back to channels-first."""
    return x.movedim(-1, 1) if channel_last else x


def _per_channel(v: Tensor, x: Tensor) -> Tensor:
    """A ``(C,)`` vector shaped to broadcast against a channels-first ``x``."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _dims(x: Tensor) -> list[int]:
    """Every dimension of a channels-first ``x`` but the channel's."""
    return [d for d in range(x.dim()) if d != 1]


def _stats64(x: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 per-channel mean and biased variance of a channels-first ``x`` (zeros for
    an empty batch, as the ops give)."""
    if x.numel() == 0:
        zeros = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        return zeros, zeros.clone()
    var, mean = torch.var_mean(x.double(), dim=_dims(x), correction=0)
    return mean, var


def _params(path: OpPath, channels: int, seed: int) -> tuple[Tensor, Tensor]:
    """A float32 weight around 1 and bias of ``channels`` values on ``path``'s device."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(channels, generator=g) + 0.5
    bias = torch.randn(channels, generator=g)
    return weight.to(path.device), bias.to(path.device)


def _stats_of(x: Tensor) -> tuple[Tensor, Tensor]:
    """The float32 ``mean`` and ``invstd`` (of the float64 statistics) of a channels-first
    ``x``: the batch statistics the elementwise ops take."""
    mean64, var64 = _stats64(x)
    return mean64.float(), torch.rsqrt(var64 + EPS).float()


def _output_tol(dtype: torch.dtype) -> dict[str, float]:
    """One rounding to ``dtype`` after float32 math (torch.testing's tolerance for 16 bits)."""
    return F32_TOL if dtype in (torch.float32, torch.float64) else {}


def _close(actual: Tensor, expected: Tensor, shape: tuple[int, ...], **tol: float) -> None:
    """``torch.testing.assert_close`` of the result for a batch of ``shape``, saying which."""
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"shape {shape}: {m}")


def _assert_sums(got: Tensor, terms64: Tensor, what: str) -> None:
    """``got`` is the float32 per-channel sum of the float64 ``terms64`` (channels-first)."""
    assert got.dtype == torch.float32 and got.shape == (terms64.shape[1],)
    want, magnitude = terms64.sum(_dims(terms64)), terms64.abs().sum(_dims(terms64))
    err = (got.double() - want).abs()
    bound = SUM_RTOL * magnitude + 1e-6
    assert bool((err <= bound).all()), f"{what}: error {(err - bound).max().item()} past its bound"


def _assert_cancelling(got: Tensor, terms: tuple[Tensor, ...], factor: Tensor, what: str) -> None:
    """``got`` is float64 ``(terms[0] - terms[1] - ...) * factor``: float32 math held to the terms'
    size, as they cancel (a GPU's fused multiply-add rounds otherwise), then one rounding."""
    want = (terms[0] - sum(terms[1:])) * factor
    rtol = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}.get(got.dtype, 1e-5)  # torch.testing's
    bound = SUM_RTOL * sum(t.abs() for t in terms) * factor.abs() + rtol * want.abs() + 1e-5
    err = (got.double() - want).abs() - bound
    assert bool((err <= 0).all()), f"{what}: off by {err.max().item()} past its bound"


# --- statistics ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", WELFORD_MEAN_VAR, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_welford_mean_var_matches_float64(path: OpPath, dtype: torch.dtype, channel_last: bool):
    welford = path.kernel_op("syncbn_welford_mean_var")
    for shape in _shapes(path):
        x = _batch(path, shape, dtype, 0)
        mean64, var64 = _stats64(x)
        mean, var = welford(_layout(x, channel_last), channel_last)
        assert mean.dtype == var.dtype == torch.float32, shape
        assert mean.shape == var.shape == (shape[1],), shape
        _close(mean, mean64.float(), shape, **F32_TOL)
        _close(var, var64.float(), shape, **F32_TOL)


@pytest.mark.parametrize("path", WELFORD_MEAN_VAR, indirect=True)
def test_welford_mean_var_of_an_empty_batch_is_zero(path: OpPath):
    welford = path.kernel_op("syncbn_welford_mean_var")
    for shape, channel_last in (((0, 4, 3), False), ((0, 6), True)):
        channels = shape[-1] if channel_last else shape[1]
        mean, var = welford(torch.empty(shape, device=path.device), channel_last)
        zeros = torch.zeros(channels, device=path.device)
        assert torch.equal(mean, zeros) and torch.equal(var, zeros), shape


@pytest.mark.parametrize("path", WELFORD_PARALLEL, indirect=True)
@pytest.mark.parametrize("splits", [SPLITS, (1, 1), (0, 7), (1000, 1)])
@pytest.mark.parametrize("counts_dtype", [torch.int64, torch.float32])
def test_welford_parallel_merges_unequal_counts_exactly(
    path: OpPath, splits: tuple[int, ...], counts_dtype: torch.dtype
):
    merge = path.kernel_op("syncbn_welford_parallel")
    for channels in (4, 513):  # 513: more channels than a block of threads
        x = _batch(path, (sum(splits), channels, 3), torch.float32, 1)
        parts = [_stats64(p) for p in x.split(list(splits))]
        means = torch.stack([m for m, _ in parts]).float()  # (world, C)
        variances = torch.stack([v for _, v in parts]).float()
        counts = path.tensor([3 * n for n in splits], counts_dtype)
        mean, var, invstd = merge(means, variances, counts, EPS)
        mean64, var64 = _stats64(x)
        torch.testing.assert_close(mean, mean64.float(), **F32_TOL)
        torch.testing.assert_close(var, var64.float(), **F32_TOL)
        torch.testing.assert_close(invstd, torch.rsqrt(var64 + EPS).float(), **F32_TOL)


@pytest.mark.parametrize("path", WELFORD_PARALLEL, indirect=True)
def test_welford_parallel_with_no_elements_anywhere(path: OpPath):
    zeros = torch.zeros(2, 3, device=path.device)
    mean, var, invstd = path.kernel_op("syncbn_welford_parallel")(
        zeros, zeros.clone(), path.tensor([0, 0]), 0.25
    )
    assert torch.equal(mean, torch.zeros(3, device=path.device))
    assert torch.equal(var, torch.zeros(3, device=path.device))
    assert torch.equal(invstd, torch.full((3,), 2.0, device=path.device))


# --- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FORWARD, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize(("affine", "with_z", "fuse_relu"), [
    (True, False, False), (False, False, False), (True, True, True), (True, False, True),
])  # fmt: skip
def test_forward_matches_float64(
    path: OpPath,
    dtype: torch.dtype,
    channel_last: bool,
    affine: bool,
    with_z: bool,
    fuse_relu: bool,
):
    forward = path.kernel_op("syncbn_forward")
    for shape in _shapes(path):
        x = _batch(path, shape, dtype, 2)
        z = _batch(path, shape, dtype, 3) if with_z else None
        weight, bias = _params(path, shape[1], 4) if affine else (None, None)
        mean, invstd = _stats_of(x)
        expected = (x.double() - _per_channel(mean.double(), x)) * _per_channel(invstd.double(), x)
        if weight is not None and bias is not None:
            expected = expected * _per_channel(weight.double(), x) + _per_channel(bias.double(), x)
        if z is not None:
            expected = expected + z.double()
        if fuse_relu:
            expected = torch.relu(expected)
        z_arg = None if z is None else _layout(z, channel_last)
        y = forward(
            _layout(x, channel_last), mean, invstd, weight, bias, z_arg, fuse_relu, channel_last
        )
        assert y.dtype == dtype, shape
        y = _channels_first(y, channel_last)
        _close(y, expected.to(dtype), shape, **_output_tol(dtype))


# --- backward --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", REDUCE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_reduce_sums_dy_and_dy_times_x_minus_mean(
    path: OpPath, dtype: torch.dtype, channel_last: bool
):
    reduce = path.kernel_op("syncbn_reduce")
    for shape in _shapes(path):
        x, dy = _batch(path, shape, dtype, 6), _batch(path, shape, dtype, 7)
        mean, _ = _stats_of(x)
        sum_dy, sum_dy_xmu = reduce(
            _layout(dy, channel_last), _layout(x, channel_last), mean, channel_last
        )
        dy64 = dy.double()
        _assert_sums(sum_dy, dy64, f"sum_dy of {shape}")
        xmu64 = x.double() - _per_channel(mean.double(), x)
        _assert_sums(sum_dy_xmu, dy64 * xmu64, f"sum_dy_xmu of {shape}")


@pytest.mark.parametrize("path", BACKWARD, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_backward_matches_the_float64_formula(path: OpPath, dtype: torch.dtype, channel_last: bool):
    """``dx = (dy - sum_dy / count - (x - mean) * invstd^2 * sum_dy_xmu / count) * invstd * w``
    for given statistics and sums (of a larger batch than this rank's: any count)."""
    backward = path.kernel_op("syncbn_backward")
    for shape in _shapes(path):
        x, dy = _batch(path, shape, dtype, 8), _batch(path, shape, dtype, 9)
        mean, invstd = _stats_of(x)
        weight, _ = _params(path, shape[1], 10)
        count = 3 * (x.numel() // shape[1])
        xmu64 = x.double() - _per_channel(mean.double(), x)
        sum_dy = (3 * dy.double().sum(_dims(x))).float()
        sum_dy_xmu = (3 * (dy.double() * xmu64).sum(_dims(x))).float()
        inv64 = _per_channel(invstd.double(), x)
        mean_dy, mean_dy_xmu = (_per_channel(s.double(), x) / count for s in (sum_dy, sum_dy_xmu))
        terms = (dy.double(), mean_dy, xmu64 * inv64**2 * mean_dy_xmu)
        factor = inv64 * _per_channel(weight.double(), x)
        dx = backward(
            _layout(dy, channel_last), _layout(x, channel_last), mean, invstd, weight, sum_dy,
            sum_dy_xmu, count, channel_last,
        )  # fmt: skip
        assert dx.dtype == dtype, shape
        _assert_cancelling(_channels_first(dx, channel_last), terms, factor, f"shape {shape}")


def _simulated_ranks(
    path: OpPath, x: Tensor, dy: Tensor, weight: Tensor, channel_last: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """A synchronized batch norm's backward over ranks holding ``SPLITS`` rows of the
    channels-first ``x``: ``(dx, dweight, dbias)``, dx channels-first."""
    welford = path.kernel_op("syncbn_welford_mean_var")
    reduce = path.kernel_op("syncbn_reduce")
    backward = path.kernel_op("syncbn_backward")
    xs = [_layout(p, channel_last) for p in x.split(list(SPLITS))]
    dys = [_layout(p, channel_last) for p in dy.split(list(SPLITS))]
    stats = [welford(p, channel_last) for p in xs]
    counts = path.tensor([p.numel() // x.shape[1] for p in xs])
    mean, _, invstd = path.kernel_op("syncbn_welford_parallel")(
        torch.stack([m for m, _ in stats]), torch.stack([v for _, v in stats]), counts, EPS
    )
    reduced = [reduce(d, p, mean, channel_last) for d, p in zip(dys, xs, strict=True)]
    sum_dy = torch.stack([r[0] for r in reduced]).sum(0)  # the all-reduce
    sum_dy_xmu = torch.stack([r[1] for r in reduced]).sum(0)
    count = int(counts.sum())
    dxs = [
        backward(d, p, mean, invstd, weight, sum_dy, sum_dy_xmu, count, channel_last)
        for d, p in zip(dys, xs, strict=True)
    ]
    dx = torch.cat([_channels_first(d, channel_last) for d in dxs])
    # Each rank's weight and bias gradients are its own sums; DDP adds them up.
    return dx, sum_dy_xmu * invstd, sum_dy


@pytest.mark.parametrize("path", ALL_OPS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("shape", [(16, 3, 5), (16, 4, 3, 2), (16, 6)])
def test_backward_over_simulated_ranks_matches_autograd(
    path: OpPath, dtype: torch.dtype, channel_last: bool, shape: tuple[int, ...]
):
    x, dy = _batch(path, shape, dtype, 4), _batch(path, shape, dtype, 5)
    weight, bias = _params(path, shape[1], 11)
    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    y64 = F.batch_norm(x64, None, None, w64, b64, True, 0.0, EPS)
    dx64, dw64, db64 = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
    dx, dweight, dbias = _simulated_ranks(path, x, dy, weight, channel_last)
    assert dx.dtype == dtype and dweight.dtype == dbias.dtype == torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(dx, dx64.to(dtype), **tol)
    torch.testing.assert_close(dweight, dw64.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias, db64.float(), rtol=1e-4, atol=1e-4)


# --- float64 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_OPS, indirect=True)
@pytest.mark.parametrize("channel_last", [False, True])
def test_float64_is_computed_in_float32_and_returned_in_float64(path: OpPath, channel_last: bool):
    """A float64 batch is taken by every op (on CUDA by the kernels' C++ reference): statistics
    and sums in float32, outputs in float64, as close to float64 math as float32's."""
    shape = (6, 5) if channel_last else (4, 5, 7)
    x = _batch(path, shape, torch.float64, 3)
    dy = _batch(path, shape, torch.float64, 4)
    z = _batch(path, shape, torch.float64, 5)
    weight, bias = (p.double() for p in _params(path, 5, 6))
    args = (_layout(x, channel_last), channel_last)

    mean, var = path.kernel_op("syncbn_welford_mean_var")(*args)
    mean64, var64 = _stats64(x)
    assert mean.dtype == var.dtype == torch.float32
    torch.testing.assert_close(mean, mean64.float(), **F32_TOL)
    torch.testing.assert_close(var, var64.float(), **F32_TOL)

    mean, invstd = _stats_of(x)
    y = path.kernel_op("syncbn_forward")(
        args[0], mean, invstd, weight, bias, _layout(z, channel_last), True, channel_last
    )
    xhat64 = (x - _per_channel(mean.double(), x)) * _per_channel(invstd.double(), x)
    y64 = torch.relu(xhat64 * _per_channel(weight, x) + _per_channel(bias, x) + z)
    assert y.dtype == torch.float64
    torch.testing.assert_close(_channels_first(y, channel_last), y64, **F32_TOL)

    sum_dy, sum_dy_xmu = path.kernel_op("syncbn_reduce")(
        _layout(dy, channel_last), args[0], mean, channel_last
    )
    xmu64 = x - _per_channel(mean.double(), x)
    _assert_sums(sum_dy, dy, "sum_dy")
    _assert_sums(sum_dy_xmu, dy * xmu64, "sum_dy_xmu")

    count = x.numel() // 5
    dx = path.kernel_op("syncbn_backward")(
        _layout(dy, channel_last), args[0], mean, invstd, weight, sum_dy, sum_dy_xmu, count,
        channel_last,
    )  # fmt: skip
    inv64 = _per_channel(invstd.double(), x)
    dx64 = (
        dy
        - _per_channel(sum_dy.double(), x) / count
        - xmu64 * inv64**2 * _per_channel(sum_dy_xmu.double(), x) / count
    ) * (inv64 * _per_channel(weight, x))
    assert dx.dtype == torch.float64
    torch.testing.assert_close(_channels_first(dx, channel_last), dx64, **F32_TOL)


@pytest.mark.parametrize("path", ALL_OPS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
def test_an_input_without_a_channel_dimension_is_refused(path: OpPath, dtype: torch.dtype) -> None:
    """Every path, the inputs a CUDA kernel hands to the C++ reference (float64) too."""
    x = torch.randn(6, device=path.device, dtype=dtype)
    stat = torch.ones(1, device=path.device)
    calls = {
        "syncbn_welford_mean_var": lambda op: op(x, False),
        "syncbn_forward": lambda op: op(x, stat, stat, None, None, None, False, False),
        "syncbn_reduce": lambda op: op(x, x, stat, False),
        "syncbn_backward": lambda op: op(x, x, stat, stat, None, stat, stat, 6, False),
    }
    for name, call in calls.items():
        message = rf"^{name}: input needs a batch and a channel dimension, got sizes \[6\]$"
        with pytest.raises(RuntimeError, match=message):
            call(path.kernel_op(name))


@pytest.mark.parametrize("path", ALL_OPS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
@pytest.mark.parametrize("count", [0, -3])
def test_backward_refuses_a_count_that_is_not_positive(
    path: OpPath, dtype: torch.dtype, count: int
) -> None:
    x = torch.randn(4, 3, device=path.device, dtype=dtype)
    stat = torch.ones(3, device=path.device)
    message = (
        r"^syncbn_backward: count \(elements per channel over the whole batch\) must be "
        rf"positive, got {count}$"
    )
    with pytest.raises(RuntimeError, match=message):
        path.kernel_op("syncbn_backward")(x, x, stat, stat, None, stat, stat, count, False)


@pytest.mark.parametrize("path", ALL_OPS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("length", [1, 4])
def test_a_statistic_of_another_length_is_refused(
    path: OpPath, dtype: torch.dtype, channel_last: bool, length: int
) -> None:
    """A per-channel statistic of one element (which would broadcast) or of another length."""
    x = _layout(torch.randn(4, 3, 5, device=path.device, dtype=dtype), channel_last)
    good, bad = torch.ones(3, device=path.device), torch.ones(length, device=path.device)
    calls = {
        ("syncbn_forward", "mean"): lambda op: op(x, bad, good, None, None, None, False,
                                                  channel_last),
        ("syncbn_forward", "invstd"): lambda op: op(x, good, bad, None, None, None, False,
                                                    channel_last),
        ("syncbn_reduce", "mean"): lambda op: op(x, x, bad, channel_last),
        ("syncbn_backward", "sum_dy"): lambda op: op(x, x, good, good, None, bad, good, 20,
                                                     channel_last),
        ("syncbn_backward", "sum_dy_xmu"): lambda op: op(x, x, good, good, None, good, bad, 20,
                                                         channel_last),
    }  # fmt: skip
    for (name, argument), call in calls.items():
        message = (
            rf"^{name}: {argument} must be a contiguous \(3,\) tensor on {x.device}, got "
            rf"\[{length}\] on {bad.device}$"
        )
        with pytest.raises(RuntimeError, match=message):
            call(path.kernel_op(name))
