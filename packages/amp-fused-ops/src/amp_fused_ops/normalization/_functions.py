"""Apex's fused-norm autograd Functions (``apex.normalization.fused_layer_norm``), on our ops.

Code written against Apex calls these directly, e.g. megatron-core's
``FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps,
memory_efficient)``. Each ``forward`` has Apex's argument list and runs the same custom ops as
the modules (``torch.ops.amp_fused_ops.norm_forward`` / ``norm_backward``: CUDA kernel, CPU
kernel or reference), with autocast off, as Apex's Functions ran their extension: casting is the
business of the functional forms and modules around them. ``memory_efficient=True`` saves the
output instead of the input for backward, as in Apex, unless the weight has a zero: the output
of that column is then the bias alone and cannot give back the input, so the input is saved
(exact gradients where Apex's were nan).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.normalization._compile import prepare_compile
from amp_fused_ops.normalization._ops import NORM_BACKWARD, NORM_FORWARD, saves_output

__all__ = [
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    "manual_rms_norm",
]

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _trailing_size(input: Tensor, normalized_shape: int | Sequence[int]) -> int:
    """The number of elements normalized together; checks that the input ends with them."""
    if isinstance(normalized_shape, (int, numbers.Integral)):
        shape: tuple[int, ...] = (int(normalized_shape),)
    else:
        shape = tuple(int(d) for d in normalized_shape)
    if not shape or input.dim() < len(shape) or tuple(input.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"input of shape {tuple(input.shape)} does not end with normalized_shape "
            f"{normalized_shape!r}; the normalized dimensions must be the input's last ones"
        )
    hidden = 1
    for d in shape:
        hidden *= d
    return hidden


def _flat(t: Tensor | None, hidden: int) -> Tensor | None:
    return None if t is None else t.reshape(hidden).contiguous()


def _forward(
    ctx: Any,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    normalized_shape: int | Sequence[int],
    eps: float,
    memory_efficient: bool,
    *,
    rms: bool,
    mixed: bool,
) -> Tensor:
    hidden = _trailing_size(input, normalized_shape)
    rows = input.reshape(-1, hidden).contiguous()  # (M, N)
    w, b = _flat(weight, hidden), _flat(bias, hidden)
    device_type = input.device.type
    prepare_compile()
    if device_type in _AUTOCAST_DEVICE_TYPES:
        with torch.autocast(device_type, enabled=False):
            out, mean, invvar = NORM_FORWARD(rows, w, b, float(eps), rms, mixed, memory_efficient)
    else:
        out, mean, invvar = NORM_FORWARD(rows, w, b, float(eps), rms, mixed, memory_efficient)
    # The output recovers the input unless a weight is zero (then the input is saved).
    memory_efficient = saves_output(bool(memory_efficient), w)
    ctx.save_for_backward(out if memory_efficient else rows, mean, invvar, w, b)
    ctx.rms = rms
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype = input.dtype
    ctx.input_shape = input.shape
    ctx.param_shapes = (
        None if weight is None else weight.shape,
        None if bias is None else bias.shape,
    )
    return out.view(input.shape)


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
    saved, mean, invvar, w, b = ctx.saved_tensors
    grad_rows = grad_output.reshape(saved.shape).contiguous()
    dx, dw, db = NORM_BACKWARD(
        grad_rows, saved, mean, invvar, w, b, ctx.rms, ctx.memory_efficient, ctx.input_dtype
    )
    weight_shape, bias_shape = ctx.param_shapes
    grad_weight = dw.view(weight_shape) if weight_shape is not None else None
    grad_bias = db.view(bias_shape) if bias_shape is not None and not ctx.rms else None
    return dx.view(ctx.input_shape), grad_weight, grad_bias


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """LayerNorm with weight and bias; output in the input's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        bias: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, weight, bias, normalized_shape, eps, memory_efficient,
            rms=False, mixed=False,
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        dx, dw, db = _backward(ctx, grad_output)
        return dx, dw, db, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """LayerNorm with weight and bias; output in the weight's dtype (fp32 params, half input)."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        bias: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, weight, bias, normalized_shape, eps, memory_efficient,
            rms=False, mixed=True,
        )  # fmt: skip


class FusedLayerNormFunction(torch.autograd.Function):
    """LayerNorm without parameters."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, None, None, normalized_shape, eps, memory_efficient,
            rms=False, mixed=False,
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        dx, _, _ = _backward(ctx, grad_output)
        return dx, None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """RMSNorm with a weight; output in the input's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, weight, None, normalized_shape, eps, memory_efficient,
            rms=True, mixed=False,
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        dx, dw, _ = _backward(ctx, grad_output)
        return dx, dw, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """RMSNorm with a weight; output in the weight's dtype (fp32 weight, half input)."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, weight, None, normalized_shape, eps, memory_efficient,
            rms=True, mixed=True,
        )  # fmt: skip


class FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm without a weight."""

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        normalized_shape: int | Sequence[int],
        eps: float,
        memory_efficient: bool = False,
    ) -> Tensor:
        return _forward(
            ctx, input, None, None, normalized_shape, eps, memory_efficient,
            rms=True, mixed=False,
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        dx, _, _ = _backward(ctx, grad_output)
        return dx, None, None, None


def manual_rms_norm(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float
) -> Tensor:
    """RMSNorm in plain PyTorch ops, as Apex's ``manual_rms_norm`` (its non-CUDA fallback).

    The mean square is taken in float32; the result is cast to the weight's dtype when that is
    half, then scaled by the weight.

    Args:
        input: Input whose trailing dimensions are ``normalized_shape``.
        normalized_shape: The trailing shape normalized over (a sequence).
        weight: Scale, or None.
        eps: Added to the mean square.

    Returns:
        The normalized tensor (float32 unless the weight is half, as in Apex).
    """
    dims = tuple(range(-len(normalized_shape), 0))
    mean_square = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    normalized = input * torch.rsqrt(mean_square + eps)
    if weight is None:
        return normalized
    if weight.dtype in (torch.float16, torch.bfloat16):
        normalized = normalized.to(weight.dtype)
    return weight * normalized
