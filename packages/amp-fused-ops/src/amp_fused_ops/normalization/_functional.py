"""Apex's fused LayerNorm / RMSNorm functions (``apex.normalization.fused_layer_norm``).

Every entry point reshapes the input to ``(rows, hidden)`` and calls the dispatcher op
``torch.ops.amp_fused_ops.norm_forward`` (CUDA kernel or fp32-accumulating PyTorch reference,
see :mod:`amp_fused_ops.ops._kernel_ops`; its autograd formula in
:mod:`amp_fused_ops.normalization._ops`); :func:`normalize` is the one call the modules of
:mod:`amp_fused_ops.normalization._modules` make too. The math is fp32 whatever the dtypes.
Under ``torch.autocast`` they do what Apex's did: input and parameters are cast to the autocast
dtype and the output is in it (fp32 statistics inside). Under amp O1, whose policy runs
``layer_norm`` in fp32, they return fp32 like ``layer_norm``.

While ``torch.jit.trace`` / ``torch.jit.script`` or ``torch.onnx.export`` runs, they fall back
to plain PyTorch ops (``F.layer_norm``; RMSNorm written out), as Apex's modules did, so the
traced graph and the exported model hold only standard operators.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from amp_fused_ops.normalization._compile import prepare_compile
from amp_fused_ops.normalization._ops import NORM_FORWARD
from amp_fused_ops.reference._norm import check_floating, output_dtype

__all__ = [
    "ShapeArg",
    "as_shape",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
    "normalize",
]

ShapeArg = int | Sequence[int] | torch.Size


def as_shape(normalized_shape: ShapeArg) -> tuple[int, ...]:
    if isinstance(normalized_shape, (int, numbers.Integral)):
        shape: tuple[int, ...] = (int(normalized_shape),)
    else:
        shape = tuple(int(d) for d in normalized_shape)
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(
            f"normalized_shape must be a non-empty sequence of positive sizes, got "
            f"{normalized_shape!r}; pass the trailing dimensions of the input, e.g. (1024,)"
        )
    return shape


def _exporting() -> bool:
    """Tracing, scripting or ONNX export: the graph must hold standard operators only."""
    return torch.jit.is_tracing() or torch.jit.is_scripting() or _in_onnx_export()


@functools.cache
def _onnx_export_check() -> Callable[[], bool]:
    """``torch.onnx.is_in_onnx_export`` without its two imports per call (the norms ask on
    every forward): its two flags read directly, where this torch keeps them there."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return torch.onnx.is_in_onnx_export
    if not hasattr(GLOBALS, "in_onnx_export") or not hasattr(_flags, "_is_onnx_exporting"):
        return torch.onnx.is_in_onnx_export
    return lambda: bool(GLOBALS.in_onnx_export or _flags._is_onnx_exporting)


def _in_onnx_export() -> bool:
    if torch.compiler.is_compiling():  # Dynamo reads the public function's answer itself
        return torch.onnx.is_in_onnx_export()
    return _onnx_export_check()()


def _plain_norm(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    shape: tuple[int, ...],
    eps: float,
    rms: bool,
    mixed: bool,
) -> Tensor:
    """The same norm in standard PyTorch ops, fp32 math, the fused op's output dtype."""
    out_dtype = output_dtype(input, weight, mixed)
    x = input.float()
    w = weight.float() if weight is not None else None
    if not rms:
        b = bias.float() if bias is not None else None
        return F.layer_norm(x, shape, w, b, eps).to(out_dtype)
    dims = tuple(range(-len(shape), 0))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    if w is not None:
        y = y * w
    return y.to(out_dtype)


def _floating(t: Tensor | None) -> bool:
    return t is None or (t.is_floating_point() and not t.is_complex())


def normalize(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    normalized_shape: ShapeArg,
    eps: float,
    *,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> Tensor:
    # Run on every forward of the modules: each check is one cheap test on the common path.
    shape = (
        normalized_shape
        if type(normalized_shape) is torch.Size
        else torch.Size(as_shape(normalized_shape))
    )
    if not (_floating(input) and _floating(weight) and _floating(bias)):
        check_floating("FusedRMSNorm" if rms else "FusedLayerNorm", input, weight, bias)
    if _exporting():  # the plain ops check the shapes themselves
        return _plain_norm(input, weight, bias if not rms else None, shape, eps, rms, mixed)
    if len(shape) == 1:
        matches = input.dim() >= 1 and input.shape[-1] == shape[0]
    else:
        matches = input.dim() >= len(shape) and input.shape[input.dim() - len(shape) :] == shape
    if not matches:
        raise ValueError(
            f"input of shape {tuple(input.shape)} does not end with normalized_shape "
            f"{tuple(shape)}; the normalized dimensions must be the input's last ones"
        )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(param.shape)} but normalized_shape is {tuple(shape)}; "
                f"give a {name} of shape {tuple(shape)}"
            )
    if mixed and weight is None:
        raise ValueError(
            "the mixed-dtype norms need a weight (their output takes its dtype); pass one, or "
            "use fused_layer_norm / fused_rms_norm without parameters"
        )
    hidden = shape.numel()
    # The op takes rows (M, N) and parameters (N,); the kernels make their arguments contiguous
    # where they need it.
    rows = input if input.dim() == 2 and len(shape) == 1 else input.reshape(-1, hidden)
    if weight is not None and weight.dim() != 1:
        weight = weight.reshape(hidden)
    if rms:
        bias = None
    elif bias is not None and bias.dim() != 1:
        bias = bias.reshape(hidden)
    # Autocast is handled by the op's autocast kernel (it follows aten::layer_norm's policy).
    prepare_compile()
    out, _, _ = NORM_FORWARD(rows, weight, bias, float(eps), rms, mixed, memory_efficient)
    return out if rows is input else out.view(input.shape)


def fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_shape: ShapeArg,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm with scale and shift over the trailing dimensions (Apex's signature).

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape``.
        weight: Scale of shape ``normalized_shape``.
        bias: Shift of shape ``normalized_shape``.
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the variance (Apex's functional default, 1e-6; the modules use 1e-5).
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the input's dtype (fp32 where autocast runs ``layer_norm``
        in fp32).

    Raises:
        ValueError: If the input or the parameters do not match ``normalized_shape``.

    Example:
        >>> x = torch.randn(4, 16)
        >>> y = fused_layer_norm_affine(x, torch.ones(16), torch.zeros(16), (16,))
    """
    return normalize(
        input, weight, bias, normalized_shape, eps, rms=False, mixed=False,
        memory_efficient=memory_efficient,
    )  # fmt: skip


def fused_layer_norm(
    input: Tensor, normalized_shape: ShapeArg, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    """LayerNorm without parameters over the trailing dimensions (Apex's signature).

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape``.
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the variance.
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the input's dtype (fp32 where autocast runs ``layer_norm``
        in fp32).

    Raises:
        ValueError: If the input does not end with ``normalized_shape``.

    Example:
        >>> y = fused_layer_norm(torch.randn(4, 16), 16)
    """
    return normalize(
        input, None, None, normalized_shape, eps, rms=False, mixed=False,
        memory_efficient=memory_efficient,
    )  # fmt: skip


def mixed_dtype_fused_layer_norm_affine(
    input: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_shape: ShapeArg,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm whose output takes the parameters' dtype (fp32 parameters, half input).

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape`` (any float dtype).
        weight: Scale of shape ``normalized_shape``; its dtype is the output's.
        bias: Shift of shape ``normalized_shape``, in the weight's dtype.
        normalized_shape: The trailing shape normalized over.
        eps: Added to the variance.
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the weight's dtype.

    Raises:
        ValueError: If the input or the parameters do not match ``normalized_shape``.

    Example:
        >>> x = torch.randn(4, 16, dtype=torch.bfloat16)
        >>> y = mixed_dtype_fused_layer_norm_affine(x, torch.ones(16), torch.zeros(16), 16)
        >>> y.dtype
        torch.float32
    """
    return normalize(
        input, weight, bias, normalized_shape, eps, rms=False, mixed=True,
        memory_efficient=memory_efficient,
    )  # fmt: skip


def fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeArg,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing dimensions.

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape``.
        weight: Scale of shape ``normalized_shape``.
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the mean square.
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the input's dtype (fp32 where autocast runs ``layer_norm``
        in fp32).

    Raises:
        ValueError: If the input or the weight do not match ``normalized_shape``.

    Example:
        >>> y = fused_rms_norm_affine(torch.randn(4, 16), torch.ones(16), 16)
    """
    return normalize(
        input, weight, None, normalized_shape, eps, rms=True, mixed=False,
        memory_efficient=memory_efficient,
    )  # fmt: skip


def fused_rms_norm(
    input: Tensor, normalized_shape: ShapeArg, eps: float = 1e-6, memory_efficient: bool = False
) -> Tensor:
    """RMSNorm ``x / sqrt(mean(x^2) + eps)`` without a weight over the trailing dimensions.

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape``.
        normalized_shape: The trailing shape normalized over (an int or a sequence).
        eps: Added to the mean square.
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the input's dtype (fp32 where autocast runs ``layer_norm``
        in fp32).

    Raises:
        ValueError: If the input does not end with ``normalized_shape``.

    Example:
        >>> y = fused_rms_norm(torch.randn(4, 16), 16)
    """
    return normalize(
        input, None, None, normalized_shape, eps, rms=True, mixed=False,
        memory_efficient=memory_efficient,
    )  # fmt: skip


def mixed_dtype_fused_rms_norm_affine(
    input: Tensor,
    weight: Tensor,
    normalized_shape: ShapeArg,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm whose output takes the weight's dtype (fp32 weight, half input).

    Args:
        input: Input whose trailing dimensions equal ``normalized_shape`` (any float dtype).
        weight: Scale of shape ``normalized_shape``; its dtype is the output's.
        normalized_shape: The trailing shape normalized over.
        eps: Added to the mean square.
        memory_efficient: Save the output instead of the input for backward.

    Returns:
        The normalized tensor in the weight's dtype.

    Raises:
        ValueError: If the input or the weight do not match ``normalized_shape``.

    Example:
        >>> x = torch.randn(4, 16, dtype=torch.float16)
        >>> mixed_dtype_fused_rms_norm_affine(x, torch.ones(16), 16).dtype
        torch.float32
    """
    return normalize(
        input, weight, None, normalized_shape, eps, rms=True, mixed=True,
        memory_efficient=memory_efficient,
    )  # fmt: skip
