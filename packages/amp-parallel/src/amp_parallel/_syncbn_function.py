"""Synchronized batch-norm statistics and the autograd Function that uses them.

Statistics are computed in fp32 whatever the input dtype. Each rank computes its local
``(mean, M2, count)`` per channel; an ``all_gather`` brings every rank's triple and Chan's
parallel Welford merge combines them, so ranks with unequal batch sizes (even empty ones)
give exactly the statistics of the concatenated batch. The backward pass all-reduces
``(sum dy, sum dy * (x - mean))``.

:func:`local_moments` is the dispatch point for amp-fused-ops' Welford kernels: when
``amp_fused_ops`` is installed (the ``kernels`` extra) it computes the local statistics with
``amp_fused_ops.syncbn.welford_mean_var`` (a CUDA kernel on CUDA tensors, PyTorch ops
elsewhere); without it, with PyTorch ops. Both give the same results up to float rounding.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import ProcessGroup

__all__ = ["SyncBNFunction", "batch_stats", "fused_syncbn", "local_moments"]


def reduce_dims(x: Tensor, channel_last: bool) -> list[int]:
    """The dimensions statistics are taken over: all but the channel dimension."""
    channel = x.dim() - 1 if channel_last else 1
    return [d for d in range(x.dim()) if d != channel]


def stat_shape(x: Tensor, channel_last: bool) -> list[int]:
    """Shape that broadcasts a per-channel vector against ``x``."""
    if channel_last:
        return [x.shape[-1]]
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


@functools.cache
def fused_syncbn() -> ModuleType | None:
    """``amp_fused_ops.syncbn`` when amp-fused-ops is installed, else ``None`` (imported once)."""
    try:
        from amp_fused_ops import syncbn
    except ImportError:
        return None
    return syncbn


def local_moments(x: Tensor, channel_last: bool) -> tuple[Tensor, Tensor, int]:
    """Per-channel fp32 ``(mean, M2 = sum (x - mean)^2, count)`` of this rank's input."""
    channels = x.shape[-1] if channel_last else x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        zeros = torch.zeros(channels, device=x.device, dtype=torch.float32)
        return zeros, zeros.clone(), 0
    kernels = fused_syncbn()
    if kernels is not None:
        mean, var = kernels.welford_mean_var(x, channel_last=channel_last)
    else:
        var, mean = torch.var_mean(x.float(), dim=reduce_dims(x, channel_last), correction=0)
    return mean, var * count, count


def batch_stats(
    x: Tensor, channel_last: bool, group: ProcessGroup | None, sync: bool
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Mean, biased variance and element count per channel over the (group's) batch.

    Args:
        x: Input, channels in dim 1 (or the last dim when ``channel_last``).
        channel_last: Where the channels are.
        group: Process group to synchronize over (default group when ``None``).
        sync: Merge the statistics of every rank of ``group``; local statistics otherwise.

    Returns:
        ``(mean, var_biased, count, counts)``: fp32 tensors, the total count, and each rank's
        count as an int32 ``(world,)`` tensor on ``x``'s device (what Apex's
        ``syncbn.batchnorm_backward`` takes).
    """
    mean, m2, count = local_moments(x, channel_last)
    if not sync:
        counts = torch.tensor([count], dtype=torch.int32, device=x.device)
        return mean, m2 / max(count, 1), count, counts
    channels = mean.numel()
    packed = torch.cat([mean, m2, mean.new_full((1,), float(count))])  # (2C + 1,)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    table = torch.stack(gathered)  # (W, 2C + 1)
    means, m2s, counts = table[:, :channels], table[:, channels : 2 * channels], table[:, -1:]
    total = counts.sum()
    merged_mean = (means * counts).sum(0) / total.clamp(min=1)
    merged_m2 = (m2s + counts * (means - merged_mean) ** 2).sum(0)
    n = int(total.item())  # host sync: the count is needed for the running variance
    return merged_mean, merged_m2 / max(n, 1), n, counts.view(-1).to(torch.int32)


class SyncBNFunction(torch.autograd.Function):
    """``y = act(w * (x - mean) * invstd + b + z)`` with the backward reductions synchronized.

    ``mean``/``invstd`` come in as constants; when ``batch_stats`` is true the backward
    accounts for their dependence on ``x`` over the whole group (``count`` elements).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        z: Tensor | None,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        invstd: Tensor,
        counts: Tensor,
        group: ProcessGroup | None,
        sync: bool,
        batch_stats: bool,
        channel_last: bool,
        fuse_relu: bool,
    ) -> Tensor:
        shape = stat_shape(x, channel_last)
        scale = invstd if weight is None else invstd * weight.float()
        shift = -mean * scale if bias is None else bias.float() - mean * scale
        y = x.float() * scale.view(shape) + shift.view(shape)
        if z is not None:
            y = y + z.float()
        if fuse_relu:
            y = torch.relu(y)
        out = y.to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, counts, out if fuse_relu else None)
        ctx.meta = (
            group,
            sync,
            batch_stats,
            channel_last,
            z is not None,
            z.dtype if z is not None else None,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd, counts, out = ctx.saved_tensors
        group, sync, batch_stats, channel_last, has_z, z_dtype = ctx.meta
        shape = stat_shape(x, channel_last)
        dims = reduce_dims(x, channel_last)
        dy = grad_out.float()
        if out is not None:
            dy = dy.masked_fill(out <= 0, 0.0)
        need_x, need_z, need_w, need_b = ctx.needs_input_grad[:4]
        dx = dz = dw = db = None
        x_mu = x.float() - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * x_mu).sum(dims)
        if need_w and weight is not None:
            dw = (sum_dy_xmu * invstd).to(weight.dtype)  # this rank's share; DDP sums/averages
        if need_b:
            db = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        if need_x:
            w = invstd if weight is None else invstd * weight.float()
            if batch_stats:
                if sync:
                    both = torch.cat([sum_dy, sum_dy_xmu])
                    dist.all_reduce(both, group=group)
                    sum_dy, sum_dy_xmu = both.chunk(2)
                kernels = fused_syncbn()
                if kernels is not None and x.numel() > 0:
                    # Apex's kernel signature: the per-rank int32 counts, summed on the device.
                    g = grad_out if out is None else grad_out.masked_fill(out <= 0, 0)
                    dx = kernels.batchnorm_backward(
                        g, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts,
                        channel_last=channel_last,
                    )  # fmt: skip
                else:
                    n = counts.sum().clamp(min=1).float()
                    mean_dy = (sum_dy / n).view(shape)
                    proj = (sum_dy_xmu * invstd * invstd / n).view(shape)
                    dx = (dy - mean_dy - x_mu * proj) * w.view(shape)
            else:
                dx = dy * w.view(shape)
            dx = dx.to(x.dtype)
        if has_z and need_z:
            dz = dy.to(z_dtype)
        return dx, dz, dw, db, None, None, None, None, None, None, None, None
