"""The SyncBatchNorm kernels (``amp_fused_ops.syncbn``) against float64 batch norm.

PyTorch's own pieces (``torch.batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``, ``batch_norm_elemt``) exist for
CUDA only, so the CPU tests compare with float64 formulas and with autograd through
``torch.nn.functional.batch_norm`` over the whole batch; the GPU tests at the end compare the
CUDA kernels with PyTorch's CUDA ops.

"Ranks" are simulated: a batch is split unequally (one part empty), every part goes through
the per-rank functions, and the sums an all-reduce would make are taken by hand. The result
must be the batch norm of the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from amp_fused_ops import syncbn
from amp_fused_ops.extensions import _loader

HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *HALF)
SPLITS = (5, 0, 2, 9)  # batch rows per simulated rank
EPS = 1e-5


def _to_channel_last(x: Tensor) -> Tensor:
    """(N, C, *) -> (N, *, C), contiguous: the layout the channel_last functions take."""
    return x.movedim(1, -1).contiguous()


def _from_channel_last(x: Tensor) -> Tensor:
    return x.movedim(-1, 1)


def _batch(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    channels = shape[1]
    offsets = torch.linspace(-2, 3, channels, device=device).view([1, -1] + [1] * (len(shape) - 2))
    return (torch.randn(shape, generator=g, device=device) * 2 + offsets).to(dtype)


def _stats64(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp64 per-channel mean and biased variance of a channels-first tensor."""
    dims = [d for d in range(x.dim()) if d != 1]
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)
    return mean, var


def _per_channel_tol(dtype: torch.dtype) -> dict[str, float]:
    # Statistics of (exactly representable) half inputs are computed in fp32: only fp32
    # rounding separates them from the fp64 statistics of the same values.
    return {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 3), (4, 5, 7), (3, 6, 5, 4)])
@pytest.mark.parametrize("channel_last", [False, True])
def test_welford_mean_var_matches_float64(dtype, shape, channel_last):
    x = _batch(shape, dtype, 0)
    mean64, var64 = _stats64(x)
    arg = _to_channel_last(x) if channel_last else x
    mean, var = syncbn.welford_mean_var(arg, channel_last=channel_last)
    assert mean.dtype == var.dtype == torch.float32 and mean.shape == (shape[1],)
    torch.testing.assert_close(mean, mean64.float(), **_per_channel_tol(dtype))
    torch.testing.assert_close(var, var64.float(), **_per_channel_tol(dtype))


def test_welford_mean_var_of_an_empty_batch_is_zero():
    mean, var = syncbn.welford_mean_var(torch.empty(0, 4, 3))
    assert torch.equal(mean, torch.zeros(4)) and torch.equal(var, torch.zeros(4))
    mean, var = syncbn.welford_mean_var(torch.empty(0, 6), channel_last=True)
    assert torch.equal(mean, torch.zeros(6)) and torch.equal(var, torch.zeros(6))


@pytest.mark.parametrize("splits", [SPLITS, (1, 1), (0, 7), (1000, 1)])
@pytest.mark.parametrize("counts_dtype", [torch.int64, torch.float32])
def test_welford_parallel_merges_unequal_counts_exactly(splits, counts_dtype):
    x = _batch((sum(splits), 4, 3), torch.float32, 1)
    parts = x.split(list(splits))
    stats = [syncbn.welford_mean_var(p) for p in parts]
    means = torch.stack([m for m, _ in stats])  # (W, C)
    variances = torch.stack([v for _, v in stats])
    counts = torch.tensor([p.numel() // p.shape[1] for p in parts], dtype=counts_dtype)
    mean, var, invstd = syncbn.welford_parallel(means, variances, counts, EPS)
    mean64, var64 = _stats64(x)
    torch.testing.assert_close(mean, mean64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var, var64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invstd, torch.rsqrt(var64 + EPS).float(), rtol=1e-5, atol=1e-5)


def test_welford_parallel_with_no_elements_anywhere():
    mean, var, invstd = syncbn.welford_parallel(
        torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 0]), 0.25
    )
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.zeros(3))
    assert torch.equal(invstd, torch.full((3,), 2.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize(("affine", "with_z", "fuse_relu"), [
    (True, False, False), (False, False, False), (True, True, True), (True, False, True),
])  # fmt: skip
def test_batchnorm_forward_matches_float64(dtype, channel_last, affine, with_z, fuse_relu):
    x = _batch((6, 5, 4, 3), dtype, 2)
    z = _batch((6, 5, 4, 3), dtype, 3) if with_z else None
    weight = torch.rand(5) + 0.5 if affine else None
    bias = torch.randn(5) if affine else None
    mean64, var64 = _stats64(x)
    w64 = weight.double() if weight is not None else None
    b64 = bias.double() if bias is not None else None
    expected = F.batch_norm(x.double(), mean64, var64, w64, b64, False, 0.0, EPS)
    if z is not None:
        expected = expected + z.double()
    if fuse_relu:
        expected = torch.relu(expected)
    mean, invstd = mean64.float(), torch.rsqrt(var64 + EPS).float()
    args_x = _to_channel_last(x) if channel_last else x
    args_z = _to_channel_last(z) if channel_last and z is not None else z
    y = syncbn.batchnorm_forward(
        args_x, mean, invstd, weight, bias, z=args_z, fuse_relu=fuse_relu,
        channel_last=channel_last,
    )  # fmt: skip
    assert y.dtype == dtype
    y = _from_channel_last(y) if channel_last else y
    # One rounding to the output dtype after fp32 math.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, expected.to(dtype), **tol)


def _simulated_ranks(
    x: Tensor,
    dy: Tensor,
    weight: Tensor,
    splits: tuple[int, ...],
    channel_last: bool,
    count_as: str = "int",
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the per-rank pieces of a synchronized batch norm; return (dx, dweight, dbias)."""
    xs, dys = x.split(list(splits)), dy.split(list(splits))
    if channel_last:
        xs = tuple(_to_channel_last(p) for p in xs)
        dys = tuple(_to_channel_last(p) for p in dys)
    stats = [syncbn.welford_mean_var(p, channel_last=channel_last) for p in xs]
    counts = torch.tensor([p.numel() // x.shape[1] for p in xs], device=x.device)
    mean, _, invstd = syncbn.welford_parallel(
        torch.stack([m for m, _ in stats]), torch.stack([v for _, v in stats]), counts, EPS
    )
    reduced = [
        syncbn.reduce_bn(d, p, mean, invstd, weight, channel_last=channel_last)
        for d, p in zip(dys, xs, strict=True)
    ]
    sum_dy = torch.stack([r[0] for r in reduced]).sum(0)  # the all-reduce
    sum_dy_xmu = torch.stack([r[1] for r in reduced]).sum(0)
    # Apex (since its PR #980) passes the gathered int32 per-rank counts; the total works too.
    count = int(counts.sum()) if count_as == "int" else counts.to(torch.int32)
    dxs = [
        syncbn.batchnorm_backward(
            d, p, mean, invstd, weight, sum_dy, sum_dy_xmu, count, channel_last=channel_last
        )
        for d, p in zip(dys, xs, strict=True)
    ]
    if channel_last:
        dxs = [_from_channel_last(d) for d in dxs]
    dweight = torch.stack([r[2] for r in reduced]).sum(0)  # DDP sums the per-rank shares
    dbias = torch.stack([r[3] for r in reduced]).sum(0)
    return torch.cat(dxs), dweight, dbias


@pytest.mark.parametrize("count_as", ["int", "per_rank_int32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("shape", [(16, 3, 5), (16, 4, 3, 2), (16, 6)])
def test_backward_over_simulated_ranks_matches_autograd(dtype, channel_last, shape, count_as):
    x = _batch(shape, dtype, 4)
    dy = _batch(shape, dtype, 5)
    weight = torch.rand(shape[1]) + 0.5
    bias = torch.randn(shape[1])
    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    y64 = F.batch_norm(x64, None, None, w64, b64, True, 0.0, EPS)
    dx64, dw64, db64 = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
    dx, dweight, dbias = _simulated_ranks(x, dy, weight, SPLITS, channel_last, count_as)
    assert dx.dtype == dtype and dweight.dtype == dbias.dtype == torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(dx, dx64.to(dtype), **tol)
    torch.testing.assert_close(dweight, dw64.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias, db64.float(), rtol=1e-4, atol=1e-4)


def test_reduce_bn_sums_and_grad_bias_is_its_own_tensor():
    x, dy = _batch((7, 3, 4), torch.float32, 6), _batch((7, 3, 4), torch.float32, 7)
    mean, var = syncbn.welford_mean_var(x)
    invstd = torch.rsqrt(var + EPS)
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = syncbn.reduce_bn(dy, x, mean, invstd, None)
    dy64, xmu64 = dy.double(), x.double() - mean.double().view(1, 3, 1)
    torch.testing.assert_close(sum_dy, dy64.sum((0, 2)).float())
    torch.testing.assert_close(sum_dy_xmu, (dy64 * xmu64).sum((0, 2)).float())
    assert grad_weight is None  # no weight, no weight gradient
    sum_dy.mul_(4)  # what an in-place all-reduce does
    torch.testing.assert_close(grad_bias, dy64.sum((0, 2)).float())


def test_errors_name_the_offending_value():
    x = torch.randn(4, 3, 2)
    mean, invstd = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match=r"batch and a channel dimension, got shape \(5,\)"):
        syncbn.welford_mean_var(torch.randn(5))
    with pytest.raises(ValueError, match=r"counts of shape \(world,\)"):
        syncbn.welford_parallel(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1]), EPS)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\).*got \(4,\)"):
        syncbn.batchnorm_forward(x, mean, invstd, torch.ones(4), None)
    with pytest.raises(ValueError, match=r"mean must have shape \(2,\)"):
        syncbn.batchnorm_forward(x, mean, invstd, None, None, channel_last=True)
    with pytest.raises(ValueError, match=r"z must have the input's shape \(4, 3, 2\)"):
        syncbn.batchnorm_forward(x, mean, invstd, None, None, z=torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"grad_out must have the input's shape"):
        syncbn.reduce_bn(torch.randn(4, 3), x, mean, invstd, None)
    with pytest.raises(ValueError, match="got count=0"):
        syncbn.batchnorm_backward(x, x, mean, invstd, None, mean, mean, 0)
    with pytest.raises(TypeError, match=r"integer tensor.*got torch\.float32"):
        syncbn.batchnorm_backward(x, x, mean, invstd, None, mean, mean, torch.tensor([4.0]))
    with pytest.raises(ValueError, match=r"one element count per rank.*got \(2, 2\)"):
        syncbn.batchnorm_backward(
            x, x, mean, invstd, None, mean, mean, torch.ones(2, 2, dtype=torch.int32)
        )


# --- CUDA kernels against PyTorch's CUDA ops -------------------------------------------------

GPU_SHAPES = [(2, 3), (8, 5, 33), (16, 3, 56, 56), (64, 4, 7, 7), (3, 513, 9)]


@pytest.fixture(scope="module")
def cuda_kernels() -> None:
    _loader.get_extension("cuda")
    for name in ("syncbn_welford_mean_var", "syncbn_welford_parallel", "syncbn_forward",
                 "syncbn_reduce", "syncbn_backward"):  # fmt: skip
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"amp_fused_ops::{name}", "CUDA"):
            pytest.fail(f"the CUDA kernel of {name} is unavailable: "
                        f"{_loader.unavailable_reason('cuda')}")  # fmt: skip


def _layout(x: Tensor, channel_last: bool) -> Tensor:
    """Our argument for a channels-first tensor ``x`` (a contiguous (N, *, C) when last)."""
    return _to_channel_last(x) if channel_last else x


def _torch_view(x: Tensor) -> Tensor:
    """PyTorch's ops take channels-first shapes; channels_last memory where it exists."""
    if x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_cuda_kernels_match_torch_batch_norm_ops(cuda_kernels, dtype, shape, channel_last):
    x = _batch(shape, dtype, 8, "cuda")
    dy = _batch(shape, dtype, 9, "cuda")
    weight = torch.rand(shape[1], device="cuda") + 0.5
    bias = torch.randn(shape[1], device="cuda")
    ours_x, ours_dy = _layout(x, channel_last), _layout(dy, channel_last)
    theirs_x, theirs_dy = _torch_view(x), _torch_view(dy)
    stat_tol = {"rtol": 1e-5, "atol": 1e-5}

    mean, var = syncbn.welford_mean_var(ours_x, channel_last=channel_last)
    t_mean, t_invstd = torch.batch_norm_stats(theirs_x, EPS)
    torch.testing.assert_close(mean, t_mean, **stat_tol)
    torch.testing.assert_close(torch.rsqrt(var + EPS), t_invstd, **stat_tol)

    # Merge with a second "rank" holding a third of the elements.
    other = _batch((max(shape[0] // 3, 1), *shape[1:]), dtype, 10, "cuda")
    o_mean, o_var = syncbn.welford_mean_var(_layout(other, channel_last), channel_last=channel_last)
    n = x.numel() // shape[1]
    counts = torch.tensor([n, other.numel() // shape[1]], device="cuda")
    mean_all, _, invstd_all = syncbn.welford_parallel(
        torch.stack([mean, o_mean]), torch.stack([var, o_var]), counts, EPS
    )
    t_invstds = torch.rsqrt(torch.stack([var, o_var]) + EPS)
    # PyTorch's CUDA op wants counts in the input's dtype and reads the input for nothing
    # else: a float32 input keeps the counts exact (bfloat16 holds integers only to 256).
    g_mean, g_invstd = torch.batch_norm_gather_stats_with_counts(
        theirs_x.float(), torch.stack([mean, o_mean]), t_invstds, None, None, 0.1, EPS,
        counts.float(),
    )  # fmt: skip
    torch.testing.assert_close(mean_all, g_mean, **stat_tol)
    torch.testing.assert_close(invstd_all, g_invstd, rtol=1e-4, atol=1e-5)

    out_tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    y = syncbn.batchnorm_forward(ours_x, mean, t_invstd, weight, bias, channel_last=channel_last)
    t_y = torch.batch_norm_elemt(theirs_x, weight, bias, mean, t_invstd, EPS)
    y = _from_channel_last(y) if channel_last else y
    torch.testing.assert_close(y, t_y, **out_tol)

    sum_dy, sum_dy_xmu, grad_w, grad_b = syncbn.reduce_bn(
        ours_dy, ours_x, mean, t_invstd, weight, channel_last=channel_last
    )
    t_sum_dy, t_sum_dy_xmu, t_grad_w, t_grad_b = torch.batch_norm_backward_reduce(
        theirs_dy, theirs_x, mean, t_invstd, weight, True, True, True
    )
    # Against the float64 sums of the same (rounded) inputs: ours within twice PyTorch's error
    # plus float32 summation error, relative to the sum of the terms' magnitudes per channel
    # (the sums cancel: a relative tolerance on the result alone would be meaningless).
    dims = [d for d in range(theirs_x.dim()) if d != 1]
    per_channel = [1, -1] + [1] * (theirs_x.dim() - 2)
    dy64 = theirs_dy.double()
    dy_xmu64 = dy64 * (theirs_x.double() - mean.double().view(per_channel))
    invstd64 = t_invstd.double()
    refs = {
        "sum_dy": (dy64.sum(dims), dy64.abs().sum(dims)),
        "sum_dy_xmu": (dy_xmu64.sum(dims), dy_xmu64.abs().sum(dims)),
        "grad_weight": (dy_xmu64.sum(dims) * invstd64, dy_xmu64.abs().sum(dims) * invstd64),
        "grad_bias": (dy64.sum(dims), dy64.abs().sum(dims)),
    }
    ours_sums = (sum_dy, sum_dy_xmu, grad_w, grad_b)
    torch_sums = (t_sum_dy, t_sum_dy_xmu, t_grad_w, t_grad_b)
    for (name, (ref, magnitude)), a, b in zip(refs.items(), ours_sums, torch_sums, strict=True):
        err = (a.double() - ref).abs()
        bound = 2 * (b.double() - ref).abs().max() + 1e-5 * magnitude + 1e-6
        assert bool((err <= bound).all()), f"{name}: error {err.max().item()} above the bound"

    dx = syncbn.batchnorm_backward(
        ours_dy, ours_x, mean, t_invstd, weight, sum_dy, sum_dy_xmu, n, channel_last=channel_last
    )
    count_tensor = torch.tensor([n], device="cuda", dtype=torch.int32)
    t_dx = torch.batch_norm_backward_elemt(
        theirs_dy, theirs_x, mean, t_invstd, weight, sum_dy, sum_dy_xmu, count_tensor
    )
    dx = _from_channel_last(dx) if channel_last else dx
    torch.testing.assert_close(dx, t_dx, **out_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_cuda_kernels_match_the_cpu_path(cuda_kernels, dtype, channel_last):
    shape = (16, 3, 5)
    x = _batch(shape, dtype, 11)
    dy = _batch(shape, dtype, 12)
    weight = torch.rand(3) + 0.5
    dx_cpu, dw_cpu, db_cpu = _simulated_ranks(x, dy, weight, SPLITS, channel_last)
    dx, dw, db = _simulated_ranks(x.cuda(), dy.cuda(), weight.cuda(), SPLITS, channel_last)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(dx.cpu(), dx_cpu, **tol)
    torch.testing.assert_close(dw.cpu(), dw_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db.cpu(), db_cpu, rtol=1e-4, atol=1e-4)
