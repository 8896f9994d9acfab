"""The Python functions of the SyncBatchNorm kernels (``amp_fused_ops.syncbn``): what they add
to the ops.

The ops themselves (statistics, merge, forward, reduce, backward) are held to float64 formulas
on every path by ``test_contract_syncbn_ops.py``. Here: a backward whose element counts come
per rank as an int32 tensor (the functions sum them), ``reduce_bn``'s outputs when there is no
weight, and the functions' argument checks.

"Ranks" are simulated: a batch is split unequally (one part empty), every part goes through
the per-rank functions, and the sums an all-reduce would make are taken by hand. The result
must be the batch norm of the whole batch (autograd through ``F.batch_norm`` in float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from amp_fused_ops import syncbn

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


@pytest.mark.parametrize("count_as", ["per_rank_int32"])
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
