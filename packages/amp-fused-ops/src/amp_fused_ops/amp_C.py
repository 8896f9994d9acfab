"""``amp_C``: Apex's namespace of multi-tensor ops, with Apex's names and calling convention.

Each op is ``op(chunk_size, noop_flag, tensor_lists, *args)`` as in Apex's ``amp_C`` and runs
the dispatcher op ``torch.ops.amp_fused_ops.<name>`` (:mod:`amp_fused_ops.ops._registry`), which
picks the kernel by the tensors' device: the compiled CPU or CUDA kernel when that extension
is loaded, else the pure-PyTorch reference; fake kernels serve ``torch.compile`` and meta
tensors. Before the call an op

1. checks ``chunk_size`` and its scalar arguments against one table
   (:data:`amp_fused_ops.ops._preconditions.PRECONDITIONS`), so that a mistake gives the same
   ``ValueError`` and message whichever kernel runs (the per-tensor preconditions are the
   kernels' own, with the same exception types and words on every path);
2. loads the compiled extension of the tensors' device on first use (building it just in time;
   :func:`amp_fused_ops.extensions.get_extension`), so that its kernels are registered;
3. unpacks ``tensor_lists`` into the schema's list arguments and turns a Python number given
   where Apex passes a one-element tensor (``lr``, ``step``, ``inv_scale`` ...) into a tensor.

Every kernel bumps the autograd version counter of each tensor the op writes in place, so
autograd detects a tensor saved for backward and modified by an op, and caches keyed on
versions (amp O1's weight-cast cache) see the change.

Importable both ways::

    from amp_fused_ops import amp_C
    import amp_fused_ops.amp_C
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.extensions import _api as _extension_api
from amp_fused_ops.ops import _preconditions
from amp_fused_ops.ops._apex_convention import apex_convention
from amp_fused_ops.ops._registry import OPS_NAMESPACE, REGISTRY

# Every op of the registry, in its order (Apex's csrc/amp_C_frontend.cpp).
__all__ = list(REGISTRY)

# Device types a compiled extension may exist for.
_EXTENSION_DEVICE_TYPES = ("cpu", "cuda")

# Device type -> a module of ops (Apex's signatures) that runs instead of the dispatcher ops
# for tensors of that device: set only inside amp_fused_ops.emulation.amp_C_on_emulated_kernels,
# which measures whole steps on the emulated CUDA kernels.
_routes: dict[str, types.ModuleType] = {}


def _load_kernels(device_type: str) -> None:
    """Register the compiled kernels of ``device_type`` with the dispatcher (first use only).

    The loader remembers its answer per kind, so later calls are one dictionary lookup; while
    ``torch.compile`` traces, nothing is loaded (the fake kernels trace the op).
    """
    if device_type in _EXTENSION_DEVICE_TYPES and not torch.compiler.is_compiling():
        _extension_api.get_extension(device_type)


def _first_tensor(tensor_lists: Any) -> Tensor | None:
    """``tensor_lists[0][0]`` when the lists are well formed that far, else None."""
    if not isinstance(tensor_lists, Sequence) or not tensor_lists:
        return None
    first = tensor_lists[0]
    if not isinstance(first, Sequence) or not first or not isinstance(first[0], Tensor):
        return None
    return first[0]


def _op(name: str) -> Callable[..., Any]:
    """The ``amp_C`` op ``name``: checks, then the dispatcher op under Apex's convention."""
    spec = REGISTRY[name]
    call = apex_convention(name, getattr(getattr(torch.ops, OPS_NAMESPACE), name).default)

    if not spec.list_counts:  # update_scale_hysteresis: no tensor lists, no chunk size

        def plain(current_scale: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(current_scale, Tensor):
                return spec.reference(current_scale, *args, **kwargs)  # raises its TypeError
            _load_kernels(current_scale.device.type)
            return call(current_scale, *args, **kwargs)

        return functools.wraps(spec.reference)(plain)

    def op(
        chunk_size: int,
        noop_flag: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        _preconditions.check(name, chunk_size, args, kwargs)
        first = _first_tensor(tensor_lists)
        if not isinstance(noop_flag, Tensor) or (first is None and tensor_lists):
            # Malformed arguments: the reference raises the documented error for them.
            return spec.reference(chunk_size, noop_flag, tensor_lists, *args, **kwargs)
        device_type = (noop_flag if first is None else first).device.type
        routed = _routes.get(device_type) if _routes else None
        if routed is not None and hasattr(routed, name):
            return getattr(routed, name)(chunk_size, noop_flag, tensor_lists, *args, **kwargs)
        _load_kernels(device_type)
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
