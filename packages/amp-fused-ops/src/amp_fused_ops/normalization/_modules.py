"""Apex's fused LayerNorm / RMSNorm modules (``apex.normalization``).

Each module holds the parameters and makes the one call the functions of
:mod:`amp_fused_ops.normalization._functional` make (``normalize``; the dtype rules and the
fallback to plain PyTorch ops under tracing and ONNX export are described there). The autograd
Functions of ``apex.normalization.fused_layer_norm`` are in
:mod:`amp_fused_ops.normalization._functions`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from amp_fused_ops.normalization._functional import ShapeArg, as_shape, normalize

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
]


class _FusedNorm(nn.Module):
    """What FusedLayerNorm and FusedRMSNorm share: parameters, checks and the call."""

    _rms = False
    _mixed = False

    def __init__(
        self,
        normalized_shape: ShapeArg,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(as_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        self.weight: nn.Parameter | None
        self.bias: nn.Parameter | None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and not self._rms:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, bias to zeros."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` over its trailing ``normalized_shape`` dimensions."""
        return normalize(
            input, self.weight, self.bias, self.normalized_shape, self.eps, rms=self._rms,
            mixed=self._mixed, memory_efficient=self.memory_efficient,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.normalized_shape)}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, "
            f"memory_efficient={self.memory_efficient}"
        )


class FusedLayerNorm(_FusedNorm):
    """Apex's ``FusedLayerNorm``: ``torch.nn.LayerNorm`` on fused kernels.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing
    ``normalized_shape`` dimensions. Parameters are named ``weight`` and ``bias`` like
    ``torch.nn.LayerNorm``'s, so state dicts load either way. CUDA inputs use the kernels of
    the CUDA extension when it is built; other devices (and CUDA without the extension) use a
    PyTorch path with fp32 accumulation. Works under ``torch.compile`` and autocast.

    Args:
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the variance.
        elementwise_affine: Learn a per-element ``weight`` (ones) and ``bias`` (zeros).
        memory_efficient: Save the output instead of the input for backward and recompute
            the normalized input from it (``(out - bias) / weight``): one activation less kept
            alive, same gradients up to rounding (in fp16 / bf16 the output's rounding adds
            about one rounding of the dtype to the gradients). A weight with a zero makes the
            output of that column the bias alone, from which the input cannot be recovered:
            then the input is saved instead (exact gradients, no memory saved), and so it is
            under ``torch.compile`` and in a forward captured into a CUDA graph (the values
            at replay are not known). Deciding reads ``(weight == 0).any()`` on the host once
            per forward (a synchronization on CUDA; not during a capture).

    Example:
        >>> norm = FusedLayerNorm(1024)
        >>> y = norm(torch.randn(8, 128, 1024))
    """


class FusedRMSNorm(_FusedNorm):
    """Apex's ``FusedRMSNorm``: ``x / sqrt(mean(x^2) + eps) * weight``, no centering, no bias.

    Its state dict (``weight``) loads into ``torch.nn.RMSNorm`` and back.

    Args:
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the mean square.
        elementwise_affine: Learn a per-element ``weight`` (ones).
        memory_efficient: Save the output instead of the input for backward (see
            :class:`FusedLayerNorm`).

    Example:
        >>> norm = FusedRMSNorm(4096)
        >>> y = norm(torch.randn(2, 4096))
    """

    _rms = True


def _refuse_affine_off(name: str, kwargs: dict[str, object]) -> None:
    if not kwargs.pop("elementwise_affine", True):
        raise ValueError(
            f"{name} always has a weight (its output takes the weight's dtype); "
            "use FusedLayerNorm / FusedRMSNorm with elementwise_affine=False instead"
        )
    if kwargs:
        raise TypeError(
            f"{name} got unexpected keyword arguments {sorted(kwargs)}; it takes "
            "normalized_shape, eps and memory_efficient"
        )


class MixedFusedLayerNorm(FusedLayerNorm):
    """``FusedLayerNorm`` for fp32 parameters and half input; the output takes the params' dtype.

    Apex's ``MixedFusedLayerNorm`` (Megatron's mixed-precision LayerNorm): always affine;
    ``elementwise_affine=True`` is accepted and ignored, ``False`` refused.

    Args:
        normalized_shape: The trailing shape normalized over.
        eps: Added to the variance.
        memory_efficient: Save the output instead of the input for backward.
        **kwargs: Only ``elementwise_affine`` (must be true), as in Apex.

    Raises:
        ValueError: If ``elementwise_affine=False``.
        TypeError: For any other keyword argument.

    Example:
        >>> norm = MixedFusedLayerNorm(64)
        >>> norm(torch.randn(2, 64, dtype=torch.bfloat16)).dtype
        torch.float32
    """

    _mixed = True

    def __init__(
        self,
        normalized_shape: ShapeArg,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        **kwargs: object,
    ) -> None:
        _refuse_affine_off(type(self).__name__, kwargs)
        super().__init__(
            normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` for an fp32 weight and half input; the output takes the weight's dtype.

    Args:
        normalized_shape: The trailing shape normalized over.
        eps: Added to the mean square.
        memory_efficient: Save the output instead of the input for backward.
        **kwargs: Only ``elementwise_affine`` (must be true), as in Apex.

    Raises:
        ValueError: If ``elementwise_affine=False``.
        TypeError: For any other keyword argument.

    Example:
        >>> norm = MixedFusedRMSNorm(64)
        >>> norm(torch.randn(2, 64, dtype=torch.float16)).dtype
        torch.float32
    """

    _mixed = True

    def __init__(
        self,
        normalized_shape: ShapeArg,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        **kwargs: object,
    ) -> None:
        _refuse_affine_off(type(self).__name__, kwargs)
        super().__init__(
            normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient
        )
