"""Synchronized batch-norm kernels (Apex's ``syncbn`` extension): ``amp_fused_ops.syncbn``.

The per-rank pieces of a synchronized batch norm, with the collectives left to the caller
(``amp_parallel.SyncBatchNorm``):

1. :func:`welford_mean_var`: this rank's per-channel mean and biased variance (fp32);
2. :func:`welford_parallel`: merge every rank's ``(mean, var, count)`` (unequal counts allowed)
   into the batch's mean, biased variance and ``1 / sqrt(var + eps)``;
3. :func:`batchnorm_forward`: ``y = (x - mean) * invstd * weight + bias [+ z] [relu]``;
4. :func:`reduce_bn`: per-channel ``sum dy`` and ``sum dy * (x - mean)`` (all-reduce them);
5. :func:`batchnorm_backward`: the input gradient from the reduced sums and the total count.

Inputs are channels-first ``(N, C, *)`` or, with ``channel_last=True``, ``(*, C)``; fp32,
fp16 or bf16, with fp32 statistics and sums whatever the input dtype (a float64 input is
taken too, on every device: computed in fp32 as the others, the result in float64; on CUDA
by the kernels' C++ reference instead of the kernels). Each function checks its
arguments and calls one dispatcher op, ``torch.ops.amp_fused_ops.syncbn_*``
(:mod:`amp_fused_ops.ops._kernel_ops`), which runs the kernel of ``csrc/cuda/syncbn.cu`` on CUDA
and the PyTorch reference of :mod:`amp_fused_ops.reference._syncbn` elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops import _kernel_ops  # noqa: F401  (defines the ops called here)

# The ops: their CUDA kernels, or their reference (amp_fused_ops.reference._syncbn) elsewhere.
_OPS = torch.ops.amp_fused_ops

__all__ = [
    "batchnorm_backward",
    "batchnorm_forward",
    "reduce_bn",
    "welford_mean_var",
    "welford_parallel",
]


def _channels(x: Tensor, channel_last: bool, who: str) -> int:
    if x.dim() < 2:
        raise ValueError(
            f"{who} expects an input with a batch and a channel dimension, got shape "
            f"{tuple(x.shape)}; reshape it to (N, C, ...) or (..., C) with channel_last=True"
        )
    return x.shape[-1] if channel_last else x.shape[1]


def _check_vectors(channels: int, who: str, **vectors: Tensor | None) -> None:
    """Per-channel arguments must be 1-D with ``channels`` elements (no silent broadcast)."""
    for name, v in vectors.items():
        if v is not None and (v.dim() != 1 or v.shape[0] != channels):
            raise ValueError(
                f"{who}: {name} must have shape ({channels},), one value per channel, got "
                f"{tuple(v.shape)}"
            )


def _check_like(x: Tensor, who: str, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(
                f"{who}: {name} must have the input's shape {tuple(x.shape)}, got {tuple(t.shape)}"
            )


def welford_mean_var(x: Tensor, *, channel_last: bool = False) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance of ``x`` in fp32 (Apex's ``welford_mean_var``).

    Args:
        x: Input ``(N, C, *)``, or ``(*, C)`` with ``channel_last``.
        channel_last: The channel dimension is the last one.

    Returns:
        ``(mean, var_biased)``, fp32 tensors of shape ``(C,)`` (zeros for an empty batch).

    Raises:
        ValueError: If ``x`` has fewer than two dimensions.

    Example:
        >>> mean, var = welford_mean_var(torch.randn(8, 3, 4, 4))
    """
    _channels(x, channel_last, "welford_mean_var")
    mean, var = _OPS.syncbn_welford_mean_var(x, channel_last)
    return mean, var


def welford_parallel(
    means: Tensor, vars_biased: Tensor, counts: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Merge per-rank statistics (Chan's parallel formula; Apex's ``welford_parallel``).

    Args:
        means: ``(world, C)`` per-rank means.
        vars_biased: ``(world, C)`` per-rank biased variances.
        counts: ``(world,)`` per-rank element counts per channel (may differ; zero allowed),
            integer or float, on any device.
        eps: Added to the merged variance for ``invstd``.

    Returns:
        ``(mean, var_biased, invstd)`` of the concatenated batch, fp32 ``(C,)``.

    Raises:
        ValueError: If the shapes disagree.

    Example:
        >>> means, variances = torch.zeros(2, 3), torch.ones(2, 3)
        >>> m, v, inv = welford_parallel(means, variances, torch.tensor([4, 2]), 1e-5)
    """
    if means.dim() != 2 or vars_biased.shape != means.shape or counts.shape != means.shape[:1]:
        raise ValueError(
            f"welford_parallel expects means and vars of shape (world, C) and counts of shape "
            f"(world,), got {tuple(means.shape)}, {tuple(vars_biased.shape)} and "
            f"{tuple(counts.shape)}; stack the per-rank results first"
        )
    counts = counts.to(means.device)  # counts may come from the host
    mean, var, invstd = _OPS.syncbn_welford_parallel(means, vars_biased, counts, eps)
    return mean, var, invstd


def batchnorm_forward(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    z: Tensor | None = None,
    fuse_relu: bool = False,
    channel_last: bool = False,
) -> Tensor:
    """``y = (x - mean) * invstd * weight + bias [+ z]``, then ReLU if ``fuse_relu``.

    Args:
        x: Input ``(N, C, *)`` or ``(*, C)`` with ``channel_last``.
        mean: fp32 ``(C,)`` batch mean.
        invstd: fp32 ``(C,)`` ``1 / sqrt(var + eps)``.
        weight: ``(C,)`` scale or ``None``.
        bias: ``(C,)`` shift or ``None``.
        z: Tensor shaped like ``x`` added before the ReLU (residual), or ``None``.
        fuse_relu: Apply ReLU to the result.
        channel_last: The channel dimension is the last one.

    Returns:
        ``y`` in ``x``'s dtype, computed in fp32.

    Raises:
        ValueError: If a per-channel argument or ``z`` does not match ``x``.

    Example:
        >>> x = torch.randn(4, 3, 5)
        >>> mean, var = welford_mean_var(x)
        >>> y = batchnorm_forward(x, mean, torch.rsqrt(var + 1e-5), None, None)
    """
    channels = _channels(x, channel_last, "batchnorm_forward")
    _check_vectors(
        channels, "batchnorm_forward", mean=mean, invstd=invstd, weight=weight, bias=bias
    )
    _check_like(x, "batchnorm_forward", z=z)
    return _OPS.syncbn_forward(x, mean, invstd, weight, bias, z, fuse_relu, channel_last)


def reduce_bn(
    grad_out: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    *,
    channel_last: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """This rank's backward reductions (Apex's ``reduce_bn``).

    Args:
        grad_out: Gradient of the output, shaped like ``x``.
        x: The forward input.
        mean: fp32 ``(C,)`` batch mean.
        invstd: fp32 ``(C,)`` batch ``1 / sqrt(var + eps)``.
        weight: The scale (only decides whether a weight gradient is returned), or ``None``.
        channel_last: The channel dimension is the last one.

    Returns:
        ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``, fp32 ``(C,)``: ``sum dy``,
        ``sum dy * (x - mean)``, this rank's ``sum_dy_xmu * invstd`` (``None`` without a
        weight) and a copy of ``sum_dy`` (this rank's bias gradient).

    Raises:
        ValueError: If a per-channel argument or ``grad_out`` does not match ``x``.

    Example:
        >>> sum_dy, sum_dy_xmu, gw, gb = reduce_bn(dy, x, mean, invstd, weight)
    """
    channels = _channels(x, channel_last, "reduce_bn")
    _check_vectors(channels, "reduce_bn", mean=mean, invstd=invstd, weight=weight)
    _check_like(x, "reduce_bn", grad_out=grad_out)
    sum_dy, sum_dy_xmu = _OPS.syncbn_reduce(grad_out, x, mean, channel_last)
    grad_weight = sum_dy_xmu * invstd.float() if weight is not None else None
    # grad_bias is this rank's sum: its own tensor, so an in-place all-reduce of sum_dy
    # leaves it alone.
    return sum_dy, sum_dy_xmu, grad_weight, sum_dy.clone()


def batchnorm_backward(
    grad_out: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: Tensor | int,
    *,
    channel_last: bool = False,
) -> Tensor:
    """Input gradient of a batch norm with batch statistics (Apex's ``batchnorm_backward``).

    ``dx = (dy - sum_dy / count - (x - mean) * invstd^2 * sum_dy_xmu / count) * invstd * w``.

    Args:
        grad_out: Gradient of the output, shaped like ``x``.
        x: The forward input.
        mean: fp32 ``(C,)`` batch mean.
        invstd: fp32 ``(C,)`` batch ``1 / sqrt(var + eps)``.
        weight: ``(C,)`` scale or ``None``.
        sum_dy: ``(C,)`` ``sum dy`` over the whole (synchronized) batch.
        sum_dy_xmu: ``(C,)`` ``sum dy * (x - mean)`` over the whole batch.
        count: As Apex (since its PR #980): an integer tensor (int32) of each rank's elements
            per channel, ``(world,)``, summed on the device (no host sync); or the total as a
            Python ``int``.
        channel_last: The channel dimension is the last one.

    Returns:
        ``grad_input`` in ``x``'s dtype.

    Raises:
        ValueError: If an ``int`` ``count`` is not positive, or a shape does not match ``x``'s
            channels.
        TypeError: If a tensor ``count`` is not of an integer dtype.

    Example:
        >>> counts = torch.tensor([n0, n1], dtype=torch.int32)  # per rank, from all_gather
        >>> dx = batchnorm_backward(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)
    """
    channels = _channels(x, channel_last, "batchnorm_backward")
    _check_vectors(
        channels, "batchnorm_backward", mean=mean, invstd=invstd, weight=weight, sum_dy=sum_dy,
        sum_dy_xmu=sum_dy_xmu,
    )  # fmt: skip
    _check_like(x, "batchnorm_backward", grad_out=grad_out)
    if isinstance(count, Tensor):
        if count.is_floating_point() or count.is_complex() or count.dtype == torch.bool:
            raise TypeError(
                f"batchnorm_backward: count must be an integer tensor of per-rank element "
                f"counts (Apex passes int32), got {count.dtype}"
            )
        if count.dim() > 1:
            raise ValueError(
                f"batchnorm_backward: count must hold one element count per rank, shape "
                f"(world,), got {tuple(count.shape)}"
            )
        # Fold 1 / total into the sums on the device, then run with a count of 1.
        total = count.to(device=sum_dy.device).sum().float()
        sum_dy, sum_dy_xmu, count = sum_dy.float() / total, sum_dy_xmu.float() / total, 1
    elif isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(
            f"batchnorm_backward: count must be an integer tensor of per-rank counts or an "
            f"int, got {type(count).__name__}"
        )
    elif count <= 0:
        raise ValueError(
            f"batchnorm_backward needs the positive number of elements per channel over the "
            f"whole batch, got count={count}"
        )
    return _OPS.syncbn_backward(
        grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, channel_last
    )
