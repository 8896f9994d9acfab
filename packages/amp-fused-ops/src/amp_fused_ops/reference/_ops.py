"""Pure-PyTorch reference implementations of the ``amp_C`` multi-tensor ops.

Every function here has the calling convention of the Apex ``amp_C`` op of the same name::

    op(chunk_size, noop_flag, tensor_lists, *op_args)

and is the test oracle for the compiled CPU and CUDA kernels, and the path that runs when no
compiled extension is available. The reference is written for correctness first:

* math in float32 whatever the storage dtype (float32, float16 or bfloat16), results cast back
  to the dtype of the tensor they are written to;
* results are written with ``Tensor.copy_``, so every tensor keeps its shape, strides and
  memory format (contiguous, channels-last, any strided layout);
* ``chunk_size`` is validated and otherwise ignored: results never depend on it;
* no host synchronisation: skip decisions that depend on device values (the ``noop_flag``,
  non-finite gradients) are taken with ``torch.where`` on the device.

How each op treats ``noop_flag`` (a one-element int32 tensor), following Apex's kernels:

============================== ============================ ===================================
op                             skips all writes if set      sets it to 1 when
============================== ============================ ===================================
multi_tensor_scale             no (inf/nan propagate)       an input is inf/nan
multi_tensor_axpby             no (inf/nan propagate)       a checked input is inf/nan
multi_tensor_l2norm            no                           the norm is inf/nan
multi_tensor_l2norm_mp         yes (returns zero norms)     the norm is inf/nan
multi_tensor_l2norm_scale      no (inf/nan propagate)       the norm is inf/nan
multi_tensor_unscale_l2norm    no                           the norm is inf/nan
multi_tensor_adam              no (inf/nan propagate)       never
multi_tensor_adam_capturable   yes                          a grad * inv_scale is inf/nan
                                                            (then nothing is written either)
multi_tensor_adam_capturable_  yes                          a grad * inv_scale is inf/nan
master                                                      (then nothing is written either)
multi_tensor_sgd               yes                          never
multi_tensor_adagrad           no (inf/nan propagate)       never
multi_tensor_lamb              no (inf/nan propagate)       a param or update norm is inf/nan
multi_tensor_lamb_mp           yes (also when found_inf     a param or update norm is inf/nan
                               is nonzero)                  (then nothing is written either)
multi_tensor_lamb_stage1_cuda  no (inf/nan propagate)       never
multi_tensor_lamb_stage2_cuda  no (inf/nan propagate)       never
multi_tensor_novograd          no (inf/nan propagate)       a gradient norm is inf/nan
============================== ============================ ===================================

``update_scale_hysteresis`` has no noop flag and no tensor lists: it is the loss-scale update
of Megatron-style dynamic scaling with hysteresis (:mod:`amp_fused_ops.reference._scaler`).

Tensors at the same position of different lists must have the same number of elements. When
their shapes differ they are matched element by element in row-major (flattened) order, which
for contiguous tensors is Apex's memory order.

The optimizers live in :mod:`amp_fused_ops.reference._adam` (Adam),
:mod:`amp_fused_ops.reference._optim` (SGD, Adagrad),
:mod:`amp_fused_ops.reference._layerwise` (LAMB, NovoGrad) and
:mod:`amp_fused_ops.reference._lamb_stages` (the two LAMB stages and the mixed-precision
LAMB), the scaler update in :mod:`amp_fused_ops.reference._scaler`, the shared checks and
helpers in :mod:`amp_fused_ops.reference._common`; every op is importable from here.

Every op writes its outputs with ATen in-place ops (``copy_``, ``masked_fill_``), so the
autograd version counter of every tensor it writes is bumped, as the compiled kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_arguments
from amp_fused_ops.ops._sharding import per_tensor_norms
from amp_fused_ops.reference._adam import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
)
from amp_fused_ops.reference._common import (
    TensorLists,
    _any_nonfinite,
    _check,
    _check_overlap,
    _fp32,
    _raise_flag,
    _scalar,
    _write,
)
from amp_fused_ops.reference._lamb_stages import (
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
)
from amp_fused_ops.reference._layerwise import multi_tensor_lamb, multi_tensor_novograd
from amp_fused_ops.reference._optim import multi_tensor_adagrad, multi_tensor_sgd
from amp_fused_ops.reference._scaler import update_scale_hysteresis

# Every op of Apex's amp_C extension (csrc/amp_C_frontend.cpp), in its order.
__all__ = [
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "update_scale_hysteresis",
]

# ---------------------------------------------------------------------------------------------
# Elementwise ops and norms
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def multi_tensor_scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float
) -> None:
    """``out = in * scale`` for every pair; flags inf/nan inputs.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if any input holds an inf or a nan.
            Outputs are written either way (inf/nan propagate).
        tensor_lists: ``[ins, outs]``; ``outs[i]`` may be ``ins[i]`` and may have another
            dtype (for example float16 in, float32 out).
        scale: Multiplier.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.

    Example:
        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> ins, outs = [torch.ones(3, dtype=torch.half)], [torch.empty(3)]
        >>> multi_tensor_scale(2048, flag, [ins, outs], 0.5)
        >>> outs[0]
        tensor([0.5000, 0.5000, 0.5000])
    """
    op = "multi_tensor_scale"
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("ins", "outs")])
    if device is None:
        return
    _check_overlap(op, tensor_lists, (1,), in_place=[(0, 1)])
    ins, outs = tensor_lists
    found = _any_nonfinite(ins, device)
    _write(outs, torch._foreach_mul(_fp32(ins), float(scale)))
    _raise_flag(noop_flag, found)


@torch.no_grad()
def multi_tensor_axpby(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    a: float,
    b: float,
    arg_to_check: int,
) -> None:
    """``out = a * x + b * y`` for every triple; flags inf/nan in the checked inputs.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if a checked input holds an inf or a nan.
            Outputs are written either way.
        tensor_lists: ``[xs, ys, outs]``; an output may alias an input.
        a: Multiplier of ``x``.
        b: Multiplier of ``y``.
        arg_to_check: Which inputs the inf/nan check looks at: -1 both, 0 ``x``, 1 ``y``.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype, noop flag or arg_to_check.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_axpby"
    check_arguments(op, {"arg_to_check": arg_to_check})
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("xs", "ys", "outs")])
    if device is None:
        return
    _check_overlap(op, tensor_lists, (2,), in_place=[(0, 2), (1, 2)])
    xs, ys, outs = tensor_lists
    checked = (list(xs) if arg_to_check in (-1, 0) else []) + (
        list(ys) if arg_to_check in (-1, 1) else []
    )
    found = _any_nonfinite(checked, device)
    result = torch._foreach_mul(_fp32(xs), float(a))
    torch._foreach_add_(result, _fp32(ys, like=xs), alpha=float(b))
    _write(outs, result)
    _raise_flag(noop_flag, found)


def _l2norms(
    op: str,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor | float | None,
    per_tensor: bool | None,
) -> tuple[Tensor, Tensor]:
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("xs",)])
    if device is None:
        empty = torch.empty(0, dtype=torch.float32, device=noop_flag.device)
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), empty
    (xs,) = tensor_lists
    values = _fp32(xs)
    if inv_scale is not None:
        values = torch._foreach_mul(values, _scalar(op, "inv_scale", inv_scale, device))
    norms = per_tensor_norms(values, 2)  # (n,) float32, of whole tensors on DTensor shards
    # Sum of squares then sqrt, as the kernels do: an overflowing sum is inf, not rescaled.
    total = norms.square().sum().sqrt().reshape(1)
    _raise_flag(noop_flag, ~torch.isfinite(total[0]))
    per = norms if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return total, per


@torch.no_grad()
def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """L2 norm of all tensors together, and optionally of each tensor, in float32.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if the total norm is inf or nan.
        tensor_lists: ``[xs]``.
        per_tensor: Also return the norm of each tensor (None means False, as in Apex).

    Returns:
        ``(total_norm, per_tensor_norms)``: a one-element float32 tensor, and a float32 tensor
        of ``len(xs)`` norms (an empty tensor when ``per_tensor`` is false).

    Raises:
        ValueError: Malformed lists, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    return _l2norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, None, per_tensor)


@torch.no_grad()
def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor | float,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """L2 norms of ``x * inv_scale`` (the norm of unscaled gradients), in float32.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if the total norm is inf or nan.
        tensor_lists: ``[xs]``; not modified.
        inv_scale: One-element float32 tensor (Apex) or a Python number.
        per_tensor: Also return the norm of each tensor.

    Returns:
        ``(total_norm, per_tensor_norms)`` as :func:`multi_tensor_l2norm`.

    Raises:
        ValueError: Malformed lists, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    return _l2norms(
        "multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor
    )


@torch.no_grad()
def multi_tensor_l2norm_mp(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """:func:`multi_tensor_l2norm` that honours a noop flag already set (Apex's ``_mp`` norm).

    Apex's mixed-precision LAMB computes its norms with this op so that a step already marked
    as skipped does no work. When ``noop_flag`` is nonzero on entry the norms are zero (Apex
    returned uninitialized memory then); otherwise the result and the flag are those of
    :func:`multi_tensor_l2norm`.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; read, and set to 1 if the total norm is inf/nan.
        tensor_lists: ``[xs]``.
        per_tensor: Also return the norm of each tensor (None means False, as in Apex).

    Returns:
        ``(total_norm, per_tensor_norms)`` as :func:`multi_tensor_l2norm`.

    Raises:
        ValueError: Malformed lists, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_l2norm_mp"
    _check(op, chunk_size, noop_flag, tensor_lists, [("xs",)])
    skipped = noop_flag.reshape(()) != 0  # read before the norm may raise the flag
    total, per = _l2norms(op, chunk_size, noop_flag, tensor_lists, None, per_tensor)
    return total.masked_fill(skipped, 0.0), per.masked_fill(skipped, 0.0)


@torch.no_grad()
def multi_tensor_l2norm_scale(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    scale: float,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """``out = in * scale`` for every pair, and the L2 norms of the *inputs*, in one pass.

    Apex's distributed LAMB uses it to scale gradients while taking their norm. The norms are
    those of ``ins`` before scaling, as :func:`multi_tensor_l2norm` computes them.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; never read (outputs are always written, inf/nan
            propagate), set to 1 if the total norm is inf or nan.
        tensor_lists: ``[ins, outs]``; ``outs[i]`` may be ``ins[i]`` and may have another
            dtype.
        scale: Multiplier of the outputs.
        per_tensor: Also return the norm of each tensor (None means False, as in Apex).

    Returns:
        ``(total_norm, per_tensor_norms)`` of ``ins``, as :func:`multi_tensor_l2norm`.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_l2norm_scale"
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("ins", "outs")])
    if device is None:
        return _l2norms(op, chunk_size, noop_flag, [[]], None, per_tensor)
    _check_overlap(op, tensor_lists, (1,), in_place=[(0, 1)])
    ins, outs = tensor_lists
    # The norms first: an output may alias its input.
    total, per = _l2norms(op, chunk_size, noop_flag, [ins], None, per_tensor)
    _write(outs, torch._foreach_mul(_fp32(ins), float(scale)))
    return total, per
