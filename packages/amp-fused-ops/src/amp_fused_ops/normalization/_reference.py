"""Pure-PyTorch LayerNorm / RMSNorm forward and backward: the CPU path and the test oracle.

Every function works on a 2-D ``(rows, hidden)`` view of the input and accumulates in fp32
whatever the input dtype, like the CUDA kernels in ``csrc/cuda/layer_norm.cu``. The forward
returns the per-row statistics the backward needs: ``mean`` (zeros for RMSNorm) and
``invvar = 1 / sqrt(var + eps)`` (``1 / sqrt(mean(x^2) + eps)`` for RMSNorm), both fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["norm_backward_reference", "norm_forward_reference", "output_dtype"]


def output_dtype(x: Tensor, weight: Tensor | None, mixed: bool) -> torch.dtype:
    """The output dtype: the parameters' dtype for the mixed variants, else the input's."""
    return weight.dtype if mixed and weight is not None else x.dtype


def norm_forward_reference(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool, mixed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Normalize each row of ``x`` (rows, hidden); return ``(out, mean, invvar)``.

    Args:
        x: Input, 2-D ``(rows, hidden)``.
        weight: Per-column scale ``(hidden,)`` or ``None``.
        bias: Per-column shift ``(hidden,)`` or ``None`` (ignored when ``rms``).
        eps: Added to the variance (mean square for RMSNorm).
        rms: RMSNorm (no centering) instead of LayerNorm.
        mixed: Output in the weight's dtype (Apex's ``MixedFused*``) instead of the input's.

    Returns:
        ``out`` shaped like ``x``; fp32 ``mean`` and ``invvar`` of shape ``(rows,)``.
    """
    xf = x.float()  # (M, N)
    if x.shape[0] == 0:  # no rows: nothing to reduce (var_mean would warn)
        stats = xf.new_zeros((0,))
        return x.new_empty(x.shape, dtype=output_dtype(x, weight, mixed)), stats, stats.clone()
    if rms:
        mean = torch.zeros(x.shape[0], device=x.device, dtype=torch.float32)
        invvar = torch.rsqrt(xf.square().mean(dim=1) + eps)
        y = xf * invvar[:, None]
    else:
        var, mean = torch.var_mean(xf, dim=1, correction=0)
        invvar = torch.rsqrt(var + eps)
        y = (xf - mean[:, None]) * invvar[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None and not rms:
        y = y + bias.float()
    return y.to(output_dtype(x, weight, mixed)), mean, invvar


def _normalized_input(
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    rms: bool,
    memory_efficient: bool,
) -> Tensor:
    """``xhat`` (fp32): from the saved input, or recomputed from the saved output."""
    if memory_efficient:
        y = saved.float()
        if bias is not None and not rms:
            y = y - bias.float()
        return y / weight.float() if weight is not None else y
    if rms:
        return saved.float() * invvar[:, None]
    return (saved.float() - mean[:, None]) * invvar[:, None]


def norm_backward_reference(
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    rms: bool,
    memory_efficient: bool,
    input_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`norm_forward_reference`: ``(grad_input, grad_weight, grad_bias)``.

    Args:
        grad_out: Gradient of the output, ``(rows, hidden)``.
        saved: The input, or the output when ``memory_efficient`` (then the input is
            recomputed from it as ``(out - bias) / weight``).
        mean: Saved per-row mean (fp32).
        invvar: Saved per-row inverse standard deviation (fp32).
        weight: The scale, or ``None``.
        bias: The shift, or ``None``.
        rms: RMSNorm instead of LayerNorm.
        memory_efficient: ``saved`` is the output.
        input_dtype: dtype of the gradient of the input.

    Returns:
        ``grad_input`` (``input_dtype``); ``grad_weight`` and ``grad_bias`` in the parameters'
        dtypes, or empty tensors when the parameter is ``None`` (always empty ``grad_bias``
        for RMSNorm).
    """
    xhat = _normalized_input(saved, mean, invvar, weight, bias, rms, memory_efficient)
    dy = grad_out.float()
    g = dy * weight.float() if weight is not None else dy
    hidden = xhat.shape[1]
    proj = (g * xhat).sum(dim=1, keepdim=True) / hidden
    if rms:
        dx = (g - xhat * proj) * invvar[:, None]
    else:
        dx = (g - g.sum(dim=1, keepdim=True) / hidden - xhat * proj) * invvar[:, None]
    # Absent parameters get their own empty tensors: outputs of a custom op may not alias.
    empty = grad_out.new_empty
    dw = (dy * xhat).sum(dim=0).to(weight.dtype) if weight is not None else empty((0,))
    db = dy.sum(dim=0).to(bias.dtype) if bias is not None and not rms else empty((0,))
    return dx.to(input_dtype), dw, db
