"""The LayerNorm / RMSNorm custom ops: ``torch.ops.amp_fused_ops.norm_forward`` / ``_backward``.

Both are ``torch.library`` custom ops with fake (meta) implementations, so ``torch.compile``
treats them as opaque nodes, and ``norm_forward`` has its autograd formula registered. Each
runs the CUDA kernels of ``csrc/cuda/layer_norm.cu`` (``torch.ops.amp_fused_ops_cuda_ops``)
when the input is on CUDA and the CUDA extension is loaded, and the fp32-accumulating
PyTorch reference of :mod:`amp_fused_ops.normalization._reference` everywhere else.

Under ``torch.autocast`` on the input's device, ``norm_forward`` does what Apex's fused norms
did: the input and the parameters (float32 / float16 / bfloat16) are cast to the autocast
dtype, and the output is in that dtype. Under amp O1 (which runs on autocast with Apex's
policy, where ``layer_norm`` is an fp32 op) it follows ``layer_norm`` instead: half inputs are
cast to fp32 and the output is fp32. The statistics and the math are fp32 in every case. Those
autocast kernels are registered by :mod:`amp_fused_ops.normalization._autocast`, the Inductor
decompositions used off CUDA by :mod:`amp_fused_ops.normalization._compile`.

This module deliberately does not use ``from __future__ import annotations``: the custom-op
decorators read the annotations at import time.
"""

import logging
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from amp_fused_ops.extensions import _loader
from amp_fused_ops.normalization._reference import (
    norm_backward_reference,
    norm_forward_reference,
    output_dtype,
)

__all__ = [
    "backward_with_aten",
    "check_floating",
    "cuda_op",
    "forward_with_aten",
    "norm_backward",
    "norm_forward",
    "saves_output",
]

logger = logging.getLogger(__name__)

CUDA_NAMESPACE = "amp_fused_ops_cuda_ops"
"""Namespace of the ops that the CUDA extension registers with ``TORCH_LIBRARY_FRAGMENT``."""

_found: dict[str, Any] = {}


def cuda_op(name: str) -> Any | None:
    """The CUDA op ``torch.ops.amp_fused_ops_cuda_ops.<name>``, or ``None`` when not loaded.

    Loads (building just in time on first use) the CUDA extension through
    :func:`amp_fused_ops.extensions.get_extension`; the op is used when it is registered, whoever
    loaded the library that defines it.

    Args:
        name: The op's name, e.g. ``"layer_norm_fwd"``.

    Returns:
        The op overload packet, or ``None`` (the caller then takes the reference path).
    """
    if name in _found:
        return _found[name]
    _loader.get_extension("cuda")  # registers the ops as a side effect of loading
    namespace = getattr(torch.ops, CUDA_NAMESPACE)
    if not hasattr(namespace, name):
        return None
    op = getattr(namespace, name)
    _found[name] = op
    return op


_HALF = (torch.float16, torch.bfloat16)
MAX_CUDA_HIDDEN = 65536
"""The largest row length (product of ``normalized_shape``) the CUDA kernels take."""


def _kernel_supports(x_dtype: torch.dtype, x: Tensor, params: tuple[Tensor | None, ...]) -> bool:
    """Whether the CUDA kernels take these dtypes, devices and sizes (else: reference path)."""
    if not x.is_cuda or x.dim() != 2 or not 1 <= x.shape[1] <= MAX_CUDA_HIDDEN:
        return False
    present = [p for p in params if p is not None]
    if any(p.device != x.device for p in present):
        return False
    dtypes = {p.dtype for p in present}
    if len(dtypes) > 1:
        return False
    param_dtype = dtypes.pop() if dtypes else x_dtype
    return param_dtype == x_dtype or (param_dtype == torch.float32 and x_dtype in _HALF)


_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cpu_native_supported(x: Tensor, params: tuple[Tensor | None, ...], rms: bool) -> bool:
    """Whether a CPU LayerNorm can run on ATen's fused CPU kernels (``native_layer_norm``).

    They take a half input with float32 parameters and then keep fp32 statistics and fp32
    math, which is this module's contract. RMSNorm has no fused CPU kernel in ATen (its
    reference here is as fast as ``torch.nn.functional.rms_norm`` there).
    """
    # Rows of one element are all bias: ATen's backward leaves an fp32 rounding residue in
    # their (exactly zero) input gradient, the reference does not.
    if rms or x.device.type != "cpu" or x.dim() != 2 or x.numel() == 0 or x.shape[1] < 2:
        return False
    if x.dtype not in _NATIVE_DTYPES:
        return False
    return all(
        p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES for p in params if p is not None
    )


def _float(t: Tensor | None) -> Tensor | None:
    return t.float() if t is not None else None


def _native_forward(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mixed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    # float32 parameters: ATen's mixed-type kernel (fp32 statistics and math for half x); the
    # mixed variants output in the parameters' dtype, so they normalize an fp32 copy of x.
    source = x.float() if mixed else x
    out, mean, rstd = torch.ops.aten.native_layer_norm(
        source, [x.shape[1]], _float(weight), _float(bias), eps
    )
    return out.to(output_dtype(x, weight, mixed)), mean.view(-1), rstd.view(-1)


def _native_backward(
    grad_out: Tensor,
    x: Tensor,
    mean: Tensor,
    invvar: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    input_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    # The kernel wants grad_out in the dtype of the input it normalized: fp32 when the output
    # was (the mixed variants, or a float32 input), else the half input itself.
    source = x if grad_out.dtype == x.dtype else x.float()
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad_out.to(source.dtype),
        source,
        [x.shape[1]],
        mean.view(-1, 1),
        invvar.view(-1, 1),
        _float(weight),
        _float(bias),
        [True, weight is not None, bias is not None],
    )
    empty = grad_out.new_empty
    dw = dw.to(weight.dtype) if weight is not None else empty((0,))
    db = db.to(bias.dtype) if bias is not None else empty((0,))
    return dx.to(input_dtype), dw, db


def check_floating(who: str, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> None:
    """Refuse integer (or bool, complex) inputs and parameters, as ``torch.nn.LayerNorm`` does.

    Raises:
        TypeError: Naming the tensor and its dtype.
    """
    for name, t in (("input", x), ("weight", weight), ("bias", bias)):
        if t is not None and (not t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{who} normalizes floating-point tensors; got {name} of dtype {t.dtype}. "
                f"Convert it first, e.g. {name}.float()."
            )


def _dense(t: Tensor | None) -> Tensor | None:
    """The kernels take contiguous tensors (a no-op for the ones the modules pass)."""
    return t.contiguous() if t is not None else None


@torch.library.custom_op("amp_fused_ops::norm_forward", mutates_args=())
def norm_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Normalize the rows of ``x`` (rows, hidden): ``(out, mean, invvar)``.

    ``memory_efficient`` only decides what autograd saves: the output instead of the input,
    unless the weight has a zero (see :func:`saves_output`).
    """
    del memory_efficient
    check_floating("norm_forward", x, weight, bias)
    supported = _kernel_supports(x.dtype, x, (weight, bias if not rms else None))
    op = cuda_op("layer_norm_fwd") if supported else None
    if op is not None:
        shift = bias if not rms else None
        out, mean, invvar = op(_dense(x), _dense(weight), _dense(shift), eps, rms, mixed)
        return out, mean, invvar
    return forward_with_aten(x, weight, bias, eps, rms, mixed)


def forward_with_aten(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool, mixed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``norm_forward`` without the CUDA kernels: ATen's fused LayerNorm, or the reference."""
    if _cpu_native_supported(x, (weight, bias), rms):
        return _native_forward(x, weight, bias, eps, mixed)
    return norm_forward_reference(x, weight, bias, eps, rms, mixed)


@norm_forward.register_fake
def _norm_forward_fake(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    check_floating("norm_forward", x, weight, bias)
    out = x.new_empty(x.shape, dtype=output_dtype(x, weight, mixed))
    stats = x.new_empty((x.shape[0],), dtype=torch.float32)
    return out, stats, stats.clone()


@torch.library.custom_op("amp_fused_ops::norm_backward", mutates_args=())
def norm_backward(
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
    """``(grad_input, grad_weight, grad_bias)``; empty tensors for absent parameters.

    With ``memory_efficient``, ``saved`` is the output and the normalized input is recomputed
    as ``(saved - bias) / weight``: the weight must have no zero (:func:`saves_output` decides
    so for autograd; a zero gives nan gradients).
    """
    supported = _kernel_supports(input_dtype, grad_out, (weight, bias if not rms else None))
    op = cuda_op("layer_norm_bwd") if supported else None
    if op is not None:
        dx, dw, db = op(
            _dense(grad_out), _dense(saved), _dense(mean), _dense(invvar), _dense(weight),
            _dense(bias if not rms else None), rms, memory_efficient, input_dtype,
        )  # fmt: skip
        return dx, dw, db
    return backward_with_aten(
        grad_out, saved, mean, invvar, weight, bias, rms, memory_efficient, input_dtype
    )


def backward_with_aten(
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
    """``norm_backward`` without the CUDA kernels: ATen's fused LayerNorm backward, or the
    reference."""
    if not memory_efficient and _cpu_native_supported(saved, (weight, bias), rms):
        return _native_backward(grad_out, saved, mean, invvar, weight, bias, input_dtype)
    return norm_backward_reference(
        grad_out, saved, mean, invvar, weight, bias, rms, memory_efficient, input_dtype
    )


@norm_backward.register_fake
def _norm_backward_fake(
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
    dx = grad_out.new_empty(grad_out.shape, dtype=input_dtype)
    dw = torch.empty_like(weight) if weight is not None else grad_out.new_empty((0,))
    has_bias = bias is not None and not rms
    db = torch.empty_like(bias) if bias is not None and has_bias else grad_out.new_empty((0,))
    return dx, dw, db


def saves_output(memory_efficient: bool, weight: Tensor | None) -> bool:
    """Whether backward may recompute the normalized input from the output (Apex's
    ``memory_efficient`` trick), so that autograd saves the output instead of the input.

    The trick divides ``out - bias`` by the weight: a column whose weight is zero has lost its
    normalized value (its output is the bias alone), and the gradients of the input and of that
    weight need it. Then the input is saved instead, as without ``memory_efficient``, and every
    gradient is exact. So it is where the weight's values are unknown: under ``torch.compile``
    (and other tracing) and on the meta device.

    .. note::
        With ``memory_efficient`` and a weight, the forward reads ``(weight == 0).any()`` on the
        host: one synchronization with a CUDA device per call.

    Args:
        memory_efficient: Whether the caller asked to save the output.
        weight: The norm's weight (after any autocast cast), or ``None``.

    Returns:
        True when the output is saved and recovers the input; False to save the input.
    """
    if not memory_efficient:
        return False
    if weight is None:
        return True
    # Traced (torch.compile, AOT autograd, opcheck) or meta: the values are not known.
    if torch.compiler.is_compiling() or is_fake(weight) or weight.device.type == "meta":
        return False
    return not bool((weight == 0).any())


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias, _eps, rms, _mixed, memory_efficient = inputs
    out, mean, invvar = output
    memory_efficient = saves_output(memory_efficient, weight)
    saved = out if memory_efficient else x
    ctx.save_for_backward(saved, mean, invvar, weight, bias)
    ctx.rms = rms
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype = x.dtype
    ctx.mark_non_differentiable(mean, invvar)


def _backward(ctx: Any, grad_out: Tensor, _grad_mean: Tensor, _grad_invvar: Tensor) -> tuple:
    saved, mean, invvar, weight, bias = ctx.saved_tensors
    dx, dw, db = norm_backward(
        grad_out.contiguous(),
        saved,
        mean,
        invvar,
        weight,
        bias,
        ctx.rms,
        ctx.memory_efficient,
        ctx.input_dtype,
    )
    grad_weight = dw if weight is not None else None
    grad_bias = db if bias is not None and not ctx.rms else None
    return dx, grad_weight, grad_bias, None, None, None, None


norm_forward.register_autograd(_backward, setup_context=_setup_context)
