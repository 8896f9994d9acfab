"""The autograd formula of ``torch.ops.amp_fused_ops.norm_forward``, at the dispatcher.

``norm_forward`` / ``norm_backward`` are ops of :mod:`amp_fused_ops.ops._kernel_ops` (schema,
reference, fake kernel; the CUDA kernels of ``csrc/cuda/layer_norm.cu``). This module registers
the forward's kernel for the ``Autograd`` key: it runs the op below autograd (one call, whose
kernel the dispatcher picks) and records ``norm_backward`` as its gradient. So a
``FusedLayerNorm`` forward is one op call, and its backward is one more, with no Python op body
between the dispatcher and the kernel. Calls that need no gradient skip the autograd node.

The autocast kernels follow the op's entry (:mod:`amp_fused_ops.ops._autocast`), the Inductor
decompositions used off CUDA are in :mod:`amp_fused_ops.normalization._compile`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from amp_fused_ops.ops._capture import capturing
from amp_fused_ops.ops._kernel_ops import KERNEL_OPS
from amp_fused_ops.ops._registry import OPS_NAMESPACE

__all__ = ["NORM_BACKWARD", "NORM_FORWARD", "saves_output"]

NORM_FORWARD = torch.ops.amp_fused_ops.norm_forward.default
"""``norm_forward(x, weight, bias, eps, rms, mixed, memory_efficient) -> (out, mean, invvar)``
on the rows ``(rows, hidden)`` of ``x``; differentiable in ``x``, ``weight`` and ``bias``."""
NORM_BACKWARD = torch.ops.amp_fused_ops.norm_backward.default
"""``norm_backward(grad_out, saved, mean, invvar, weight, bias, rms, memory_efficient,
input_dtype) -> (grad_input, grad_weight, grad_bias)``, empty tensors for absent parameters."""

assert "norm_forward" in KERNEL_OPS  # the op this module registers the formula of


def saves_output(memory_efficient: bool, weight: Tensor | None) -> bool:
    """Whether backward may recompute the normalized input from the output (Apex's
    ``memory_efficient`` trick), so that autograd saves the output instead of the input.

    The trick divides ``out - bias`` by the weight: a column whose weight is zero has lost its
    normalized value (its output is the bias alone), and the gradients of the input and of that
    weight need it. Then the input is saved instead, as without ``memory_efficient``, and every
    gradient is exact. So it is where the weight's values are unknown: under ``torch.compile``
    (and other tracing), on the meta device, and while the call is captured into a CUDA graph
    (each replay runs on the values the weight holds then).

    .. note::
        With ``memory_efficient`` and a weight, the forward reads ``(weight == 0).any()`` on the
        host: one synchronization with a CUDA device per call, outside a capture.

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
    # Traced (torch.compile, AOT autograd, opcheck), meta or captured: the values are not known.
    if (
        torch.compiler.is_compiling()
        or is_fake(weight)
        or weight.device.type == "meta"
        or capturing(weight)
    ):
        return False
    return not bool((weight == 0).any())


class _NormForward(torch.autograd.Function):
    """The autograd node of one ``norm_forward`` call (gradient: one ``norm_backward``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        rms: bool,
        mixed: bool,
        memory_efficient: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        with torch._C._AutoDispatchBelowAutograd():
            out, mean, invvar = NORM_FORWARD(x, weight, bias, eps, rms, mixed, memory_efficient)
        memory_efficient = saves_output(memory_efficient, weight)
        ctx.save_for_backward(out if memory_efficient else x, mean, invvar, weight, bias)
        ctx.rms = rms
        ctx.memory_efficient = memory_efficient
        ctx.input_dtype = x.dtype
        ctx.mark_non_differentiable(mean, invvar)
        return out, mean, invvar

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _grad_mean: Tensor, _grad_invvar: Tensor) -> tuple:
        saved, mean, invvar, weight, bias = ctx.saved_tensors
        dx, dw, db = NORM_BACKWARD(
            grad_out.contiguous(), saved, mean, invvar, weight, bias, ctx.rms,
            ctx.memory_efficient, ctx.input_dtype,
        )  # fmt: skip
        grad_weight = dw if weight is not None else None
        grad_bias = db if bias is not None and not ctx.rms else None
        return dx, grad_weight, grad_bias, None, None, None, None


def _requires_grad(t: Tensor | None) -> bool:
    return t is not None and t.requires_grad


def _autograd_kernel(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``norm_forward``'s kernel for the ``Autograd`` key."""
    if torch.is_grad_enabled() and (
        x.requires_grad or _requires_grad(weight) or _requires_grad(bias)
    ):
        return _NormForward.apply(x, weight, bias, eps, rms, mixed, memory_efficient)
    with torch._C._AutoDispatchBelowAutograd():
        return NORM_FORWARD(x, weight, bias, eps, rms, mixed, memory_efficient)


ONCE_DIFFERENTIABLE = (
    "amp_fused_ops::norm_forward is differentiable once: its backward (norm_backward) has no "
    "gradient of its own. For double backward (create_graph=True, e.g. a gradient penalty) "
    "use torch.nn.LayerNorm / torch.nn.RMSNorm for this layer"
)
"""The error of a backward through the norm's gradients (the C++ kernels raise the same)."""


def _backward_autograd_kernel(
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
    """``norm_backward``'s kernel for the ``Autograd`` key: the op below autograd; in a backward
    with ``create_graph=True`` its results carry an error node, so that differentiating them
    raises instead of giving a silently partial gradient."""
    with torch._C._AutoDispatchBelowAutograd():
        out = NORM_BACKWARD(
            grad_out, saved, mean, invvar, weight, bias, rms, memory_efficient, input_dtype
        )
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (grad_out, saved, weight, bias)
    ):
        # The error node takes inputs that require grad (aliases of the results), as
        # torch.autograd.function.once_differentiable does.
        aliases = [t.detach().requires_grad_() for t in out]
        error = torch._C._functions.DelayedError(ONCE_DIFFERENTIABLE, 3)
        dx, dw, db = error(*aliases)
        return dx, dw, db
    return out


# Kept alive for the life of the process: dropping the library removes the registrations.
_autograd_lib = torch.library.Library(OPS_NAMESPACE, "IMPL")
_autograd_lib.impl("norm_forward", _autograd_kernel, "Autograd")
_autograd_lib.impl("norm_backward", _backward_autograd_kernel, "Autograd")
