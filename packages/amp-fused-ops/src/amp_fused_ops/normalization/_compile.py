"""The fused norm ops under ``torch.compile``: off CUDA, Inductor decomposes them.

:func:`prepare_compile`, called by the norms before the op, gives Inductor the decompositions
of ``norm_forward`` / ``norm_backward`` while Dynamo traces (not under export).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.normalization import _ops  # noqa: F401  (the ops decomposed here)
from amp_fused_ops.reference._norm import norm_backward_aten, norm_forward_aten

__all__ = ["prepare_compile"]


# --- torch.compile: the non-CUDA bodies as Inductor decompositions ----------------------------
#
# Without a CUDA kernel to run, the ops compute the norm with ATen ops (ATen's fused CPU
# LayerNorm, or the reference). Left opaque, they keep Inductor from fusing the norm with its
# neighbours as it fuses nn.LayerNorm's decomposition; given to Inductor as decompositions of
# the ops, the same ATen ops are decomposed and fused in the generated code. CUDA inputs keep
# the op (the CUDA kernels). Export is not affected: it does not use Inductor's table.


def _forward_decomposition(x: Tensor, *args: Any) -> Any:
    """``norm_forward`` for Inductor: the ATen ops it runs off CUDA (CUDA keeps the op)."""
    if x.device.type == "cuda":
        return NotImplemented
    weight, bias, eps, rms, mixed, _memory_efficient = args
    return norm_forward_aten(x, weight, bias, eps, rms, mixed)


def _backward_decomposition(grad_out: Tensor, *args: Any) -> Any:
    """``norm_backward`` for Inductor: the ATen ops it runs off CUDA (CUDA keeps the op)."""
    if grad_out.device.type == "cuda":
        return NotImplemented
    return norm_backward_aten(grad_out, *args)


def _register_inductor_decompositions() -> bool:
    """Give Inductor the decompositions above (once; run while Dynamo traces a norm).

    Inductor picks its table per compile from ``decompositions`` and a merged copy of it that
    it caches on first use: both get the ops, whichever was made first.
    """
    from torch._inductor import decomposition  # imported by torch.compile already

    ours = {
        torch.ops.amp_fused_ops.norm_forward.default: _forward_decomposition,
        torch.ops.amp_fused_ops.norm_backward.default: _backward_decomposition,
    }
    tables = [decomposition.decompositions]
    merged = getattr(decomposition, "fast_random_decomps", None)
    if merged is not None:
        tables.append(merged())
    for table in tables:
        for op, function in ours.items():
            table.setdefault(op, function)
    return True


# Dynamo runs a function so marked once while it traces and uses its result as a constant: what
# torch.compiler.assume_constant_result does. Marked here directly, because that decorator
# imports torch._dynamo, which importing this package must not (it takes seconds).
_register_inductor_decompositions._dynamo_marked_constant = True  # type: ignore[attr-defined]


def prepare_compile() -> None:
    """Called by the norms before the op: under ``torch.compile`` (not export), make sure
    Inductor may decompose the ops on devices without a CUDA kernel."""
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        _register_inductor_decompositions()
