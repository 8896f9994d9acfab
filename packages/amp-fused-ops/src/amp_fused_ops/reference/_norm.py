"""Pure-PyTorch LayerNorm / RMSNorm forward and backward: the reference of the norm ops.

Every function works on a 2-D ``(rows, hidden)`` view of the input and accumulates in fp32
whatever the input dtype, like the CUDA kernels in ``csrc/cuda/layer_norm.cu``. The forward
returns the per-row statistics the backward needs: ``mean`` (zeros for RMSNorm) and
``invvar = 1 / sqrt(var + eps)`` (``1 / sqrt(mean(x^2) + eps)`` for RMSNorm), both fp32.

:func:`norm_forward_reference` / :func:`norm_backward_reference` are the oracle of the kernels
and what :func:`amp_fused_ops.extensions.use_reference` runs. :func:`norm_forward_aten` /
:func:`norm_backward_aten` are the ops' kernels off the compiled ones (the CPU and any other
device): the same contract, on ATen's fused CPU LayerNorm where it computes the same, else
the reference. ``csrc/common/norm_reference.h`` is the reference's C++ twin.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_floating",
    "norm_backward_aten",
    "norm_backward_reference",
    "norm_forward_aten",
    "norm_forward_reference",
    "output_dtype",
]


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


def check_mixed(weight: Tensor | None, mixed: bool) -> None:
    """The mixed variants output in the weight's dtype: refuse one without a weight.

    Raises:
        ValueError: In the words of the compiled kernels' check.
    """
    if mixed and weight is None:
        raise ValueError("norm_forward: the mixed-dtype variant needs a weight")


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


# --- ATen's fused CPU LayerNorm, where it computes the same --------------------------------

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _aten_supported(x: Tensor, params: tuple[Tensor | None, ...], rms: bool) -> bool:
    """Whether a CPU LayerNorm can run on ATen's fused CPU kernels (``native_layer_norm``).

    They take a half input with float32 parameters and then keep fp32 statistics and fp32
    math, which is the ops' contract. RMSNorm has no fused CPU kernel in ATen (the reference
    is as fast as ``torch.nn.functional.rms_norm`` there).
    """
    # Rows of one element are all bias: ATen's backward leaves an fp32 rounding residue in
    # their (exactly zero) input gradient, the reference does not.
    if rms or x.device.type != "cpu" or x.dim() != 2 or x.numel() == 0 or x.shape[1] < 2:
        return False
    if x.dtype not in _NATIVE_DTYPES:
        return False
    # A half input needs a parameter: ATen keeps fp32 statistics only in its mixed-type kernel.
    if x.dtype != torch.float32 and all(p is None for p in params):
        return False
    return all(
        p.device.type == "cpu" and p.dtype in _NATIVE_DTYPES for p in params if p is not None
    )


def _float(t: Tensor | None) -> Tensor | None:
    return t.float() if t is not None else None


def norm_forward_aten(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool, mixed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`norm_forward_reference`, on ATen's fused CPU LayerNorm where it applies."""
    if not _aten_supported(x, (weight, bias), rms):
        return norm_forward_reference(x, weight, bias, eps, rms, mixed)
    # float32 parameters: ATen's mixed-type kernel (fp32 statistics and math for half x); the
    # mixed variants output in the parameters' dtype, so they normalize an fp32 copy of x.
    source = x.float() if mixed else x
    out, mean, rstd = torch.ops.aten.native_layer_norm(
        source, [x.shape[1]], _float(weight), _float(bias), eps
    )
    return out.to(output_dtype(x, weight, mixed)), mean.view(-1), rstd.view(-1)


def norm_backward_aten(
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
    """:func:`norm_backward_reference`, on ATen's fused CPU LayerNorm backward where it
    applies (not for ``memory_efficient``: ATen needs the input)."""
    if memory_efficient or not _aten_supported(saved, (weight, bias), rms):
        return norm_backward_reference(
            grad_out, saved, mean, invvar, weight, bias, rms, memory_efficient, input_dtype
        )
    # On float32 copies of a half input and its gradient: ATen's backward of a half input sums
    # the parameters' gradients in half precision; the ops' contract is fp32 math.
    source = saved.float()
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad_out.float(),
        source,
        [saved.shape[1]],
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
