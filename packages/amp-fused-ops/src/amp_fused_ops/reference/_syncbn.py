"""The PyTorch reference of the SyncBN ops (``torch.ops.amp_fused_ops.syncbn_*``).

Each function takes its op's arguments (``src/amp_fused_ops/ops/_kernel_ops.py``) and computes
in fp32 whatever the input dtype, as the CUDA kernels of ``csrc/cuda/syncbn.cu`` do: the ops'
kernel off CUDA, the kernels' test oracle and what
:func:`amp_fused_ops.extensions.use_reference` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "REFERENCES",
    "syncbn_backward",
    "syncbn_forward",
    "syncbn_reduce",
    "syncbn_welford_mean_var",
    "syncbn_welford_parallel",
]


def _dims(x: Tensor, channel_last: bool) -> list[int]:
    channel = x.dim() - 1 if channel_last else 1
    return [d for d in range(x.dim()) if d != channel]


def _check_batched(x: Tensor, op: str) -> None:
    """Refuse an input without a batch and a channel dimension, in the CUDA kernels' words."""
    if x.dim() < 2:
        raise RuntimeError(
            f"{op}: input needs a batch and a channel dimension, got sizes {list(x.shape)}"
        )


def _check_vector(v: Tensor, x: Tensor, channel_last: bool, name: str, op: str) -> None:
    """Refuse a per-channel statistic that is not one value per channel of ``x`` on its
    device, in the CUDA kernels' words (a one-element tensor would broadcast silently)."""
    channels = x.shape[-1] if channel_last else x.shape[1]
    if v.dim() != 1 or v.shape[0] != channels or v.device != x.device:
        raise RuntimeError(
            f"{op}: {name} must be a contiguous ({channels},) tensor on {x.device}, got "
            f"{list(v.shape)} on {v.device}"
        )


def _view(v: Tensor, x: Tensor, channel_last: bool) -> Tensor:
    """A per-channel vector shaped to broadcast against ``x``."""
    if channel_last:
        return v.view(-1)
    return v.view([1, -1] + [1] * (x.dim() - 2))


def syncbn_welford_mean_var(x: Tensor, channel_last: bool) -> tuple[Tensor, Tensor]:
    """The PyTorch implementation of ``syncbn_welford_mean_var`` (the op's arguments)."""
    _check_batched(x, "syncbn_welford_mean_var")
    if x.numel() == 0:
        channels = x.shape[-1] if channel_last else x.shape[1]
        zeros = torch.zeros(channels, device=x.device, dtype=torch.float32)
        return zeros, zeros.clone()
    var, mean = torch.var_mean(x.float(), dim=_dims(x, channel_last), correction=0)
    return mean, var


def syncbn_welford_parallel(
    means: Tensor, vars_biased: Tensor, counts: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The PyTorch implementation of ``syncbn_welford_parallel`` (the op's arguments)."""
    n = counts.to(torch.float64)[:, None]  # (W, 1); float64: counts can exceed 2**24
    m = means.to(torch.float64)
    total = n.sum(0)
    mean = (m * n).sum(0) / total.clamp(min=1)
    m2 = (vars_biased.to(torch.float64) * n + n * (m - mean) ** 2).sum(0)
    var = m2 / total.clamp(min=1)
    return mean.float(), var.float(), torch.rsqrt(var + eps).float()


def syncbn_forward(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    z: Tensor | None,
    fuse_relu: bool,
    channel_last: bool,
) -> Tensor:
    """The PyTorch implementation of ``syncbn_forward`` (the op's arguments)."""
    _check_batched(x, "syncbn_forward")
    for name, v in (("mean", mean), ("invstd", invstd)):
        _check_vector(v, x, channel_last, name, "syncbn_forward")
    scale = invstd.float() if weight is None else invstd.float() * weight.float()
    shift = -mean.float() * scale
    if bias is not None:
        shift = shift + bias.float()
    y = x.float() * _view(scale, x, channel_last) + _view(shift, x, channel_last)
    if z is not None:
        y = y + z.float()
    if fuse_relu:
        y = torch.relu(y)
    return y.to(x.dtype)


def syncbn_reduce(
    grad_out: Tensor, x: Tensor, mean: Tensor, channel_last: bool
) -> tuple[Tensor, Tensor]:
    """The PyTorch implementation of ``syncbn_reduce``: ``(sum dy, sum dy * (x - mean))``."""
    _check_batched(x, "syncbn_reduce")
    _check_vector(mean, x, channel_last, "mean", "syncbn_reduce")
    dims = _dims(x, channel_last)
    dy = grad_out.float()
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x.float() - _view(mean.float(), x, channel_last))).sum(dims)
    return sum_dy, sum_dy_xmu


def syncbn_backward(
    grad_out: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: int,
    channel_last: bool,
) -> Tensor:
    """The PyTorch implementation of ``syncbn_backward`` (the op's arguments)."""
    _check_batched(x, "syncbn_backward")
    stats = (("mean", mean), ("invstd", invstd), ("sum_dy", sum_dy), ("sum_dy_xmu", sum_dy_xmu))
    for name, v in stats:
        _check_vector(v, x, channel_last, name, "syncbn_backward")
    if count <= 0:
        raise RuntimeError(
            "syncbn_backward: count (elements per channel over the whole batch) must be "
            f"positive, got {count}"
        )
    inv = invstd.float()
    scale = inv if weight is None else inv * weight.float()
    mean_dy = sum_dy.float() / count
    proj = sum_dy_xmu.float() * inv * inv / count
    x_mu = x.float() - _view(mean.float(), x, channel_last)
    dx = grad_out.float() - _view(mean_dy, x, channel_last) - x_mu * _view(proj, x, channel_last)
    return (dx * _view(scale, x, channel_last)).to(x.dtype)


REFERENCES: dict[str, Callable[..., Any]] = {
    "syncbn_welford_mean_var": syncbn_welford_mean_var,
    "syncbn_welford_parallel": syncbn_welford_parallel,
    "syncbn_forward": syncbn_forward,
    "syncbn_reduce": syncbn_reduce,
    "syncbn_backward": syncbn_backward,
}
"""Name of each SyncBN op -> its reference (the op's arguments)."""
