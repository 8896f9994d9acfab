"""``amp_C``: Apex's namespace of multi-tensor ops, with Apex's names and calling convention.

Each op is ``op(chunk_size, noop_flag, tensor_lists, *args)`` as in Apex's ``amp_C`` and runs
the dispatcher op ``torch.ops.amp_fused_ops.<name>`` (:mod:`amp_fused_ops.ops._registry`), which
picks the kernel by the tensors' device: the compiled CPU or CUDA kernel when that extension
is loaded, else the pure-PyTorch reference; fake kernels serve ``torch.compile`` and meta
tensors. The first call on a device loads (or builds, just in time) that device's compiled
extension, from the op's kernel of last resort (:mod:`amp_fused_ops.ops._registry`), the one
place that loads kernels, however an op is called. ``amp_C`` only adapts Apex's calling
convention: it unpacks ``tensor_lists`` into the schema's list arguments and turns a Python
number given where Apex passes a one-element tensor (``lr``, ``step``, ``inv_scale`` ...)
into a tensor (:mod:`amp_fused_ops.ops._apex_convention`). The fused optimizers of
amp-optimizers call the dispatcher ops with the schema's own arguments instead
(:func:`amp_fused_ops.multi_tensor_op`).

``chunk_size`` and the scalar arguments are checked once per call, by the kernel that runs
(compiled or reference). When a call fails, the op's preconditions (its registry entry's,
:func:`amp_fused_ops.ops._preconditions.rules`) are consulted before the error leaves
``amp_C``, so that a mistake in those arguments gives the same ``ValueError`` and message
whichever kernel runs (the per-tensor preconditions are the kernels' own, with the same
exception types and words on every path). Under ``torch.compile`` they are checked
before the call.

Every kernel bumps the autograd version counter of each tensor the op writes in place, so
autograd detects a tensor saved for backward and modified by an op, and caches keyed on
versions (amp O1's weight-cast cache) see the change.

Importable both ways::

    from amp_fused_ops import amp_C
    import amp_fused_ops.amp_C
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops import _preconditions
from amp_fused_ops.ops._apex_convention import apex_convention
from amp_fused_ops.ops._registry import OPS_NAMESPACE, REGISTRY
from amp_fused_ops.ops._schema_calls import PLAIN_TENSOR_TYPES

# Every op of the registry, in its order (Apex's csrc/amp_C_frontend.cpp).
__all__ = list(REGISTRY)


def _all_tensors(part: Sequence[Any]) -> bool:
    """Whether every element of ``part`` is a tensor (subclasses included)."""
    return all(isinstance(t, Tensor) for t in part)


def _first_tensor(tensor_lists: Any) -> Tensor | None:
    """``tensor_lists[0][0]`` when the lists are well formed that far, else None."""
    if not isinstance(tensor_lists, Sequence) or not tensor_lists:
        return None
    first = tensor_lists[0]
    if not isinstance(first, Sequence) or not first or not isinstance(first[0], Tensor):
        return None
    return first[0]


def _op(name: str) -> Callable[..., Any]:
    """The ``amp_C`` op ``name``: the dispatcher op under Apex's convention, its scalar
    arguments checked against the table when the call fails (see the module docstring)."""
    spec = REGISTRY[name]

    if not spec.list_counts:  # update_scale_hysteresis: no tensor lists, no chunk size
        call = apex_convention(name, getattr(getattr(torch.ops, OPS_NAMESPACE), name).default)

        def plain(current_scale: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(current_scale, Tensor):
                return spec.reference(current_scale, *args, **kwargs)  # raises its TypeError
            return call(current_scale, *args, **kwargs)

        return functools.wraps(spec.reference)(plain)

    def check(chunk_size: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        _preconditions.check(name, chunk_size, args, kwargs)

    call = apex_convention(
        name, getattr(getattr(torch.ops, OPS_NAMESPACE), name).default, explain=check
    )

    def op(
        chunk_size: int,
        noop_flag: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if type(chunk_size) is not int or torch.compiler.is_compiling():
            # A bool or float chunk_size would reach a kernel as an int; a traced call is
            # checked before the call, as the error would come too late.
            check(chunk_size, args, kwargs)
        if type(tensor_lists) is list and tensor_lists and type(tensor_lists[0]) is list:
            # The usual call: lists of lists; each list checked at C speed when it holds plain
            # tensors and parameters only.
            malformed = not tensor_lists[0] or not all(
                type(part) is list
                and (PLAIN_TENSOR_TYPES.issuperset(map(type, part)) or _all_tensors(part))
                for part in tensor_lists
            )
        else:
            malformed = bool(tensor_lists) and _first_tensor(tensor_lists) is None
        if malformed or not isinstance(noop_flag, Tensor):
            # Malformed arguments: the reference raises the documented error for them.
            check(chunk_size, args, kwargs)
            return spec.reference(chunk_size, noop_flag, tensor_lists, *args, **kwargs)
        return call(chunk_size, noop_flag, tensor_lists, *args, **kwargs)

    return functools.wraps(spec.reference)(op)


# In the order of Apex's csrc/amp_C_frontend.cpp.
multi_tensor_scale = _op("multi_tensor_scale")
multi_tensor_sgd = _op("multi_tensor_sgd")
multi_tensor_axpby = _op("multi_tensor_axpby")
multi_tensor_l2norm = _op("multi_tensor_l2norm")
multi_tensor_l2norm_mp = _op("multi_tensor_l2norm_mp")
multi_tensor_l2norm_scale = _op("multi_tensor_l2norm_scale")
multi_tensor_unscale_l2norm = _op("multi_tensor_unscale_l2norm")
multi_tensor_lamb_stage1_cuda = _op("multi_tensor_lamb_stage1_cuda")
multi_tensor_lamb_stage2_cuda = _op("multi_tensor_lamb_stage2_cuda")
multi_tensor_adam = _op("multi_tensor_adam")
multi_tensor_adam_capturable = _op("multi_tensor_adam_capturable")
multi_tensor_adam_capturable_master = _op("multi_tensor_adam_capturable_master")
multi_tensor_adagrad = _op("multi_tensor_adagrad")
multi_tensor_novograd = _op("multi_tensor_novograd")
multi_tensor_lamb = _op("multi_tensor_lamb")
multi_tensor_lamb_mp = _op("multi_tensor_lamb_mp")
update_scale_hysteresis = _op("update_scale_hysteresis")
