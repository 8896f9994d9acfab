"""``amp_C``: Apex's namespace of multi-tensor ops, dispatched to a kernel or the reference.

Each op looks at the device of the first tensor of ``tensor_lists[0]`` and asks
``amp_fused_ops._loader.get_extension("cpu" | "cuda")`` for the compiled extension of that
device. When the extension is loaded and has an attribute of the op's name, that kernel runs
with exactly the arguments given; otherwise (no loader, no extension, op not compiled, another
device type, empty lists) the pure-PyTorch reference in :mod:`amp_fused_ops._reference` runs.

The compiled kernels are ops of the PyTorch dispatcher, ``torch.ops.amp_fused_ops.<op>``: one
schema per op (``csrc/common/ops_schema.h``), a kernel for the ``CPU`` dispatch key from the
C++ CPU extension and one for ``CUDA`` from the CUDA extension; the dispatcher picks it by the
device of the tensors. A schema has no list of tensor lists, so each op takes Apex's lists as
separate arguments (those it writes marked mutable). The extension "module" that
``get_extension`` returns (:func:`compiled_ops`) keeps Apex's calling convention on top:
``op(chunk_size, noop_flag, tensor_lists, *args)``, with the same names, argument order,
defaults and return values as Apex's ``amp_C``. It unpacks ``tensor_lists`` (a wrong number of
lists is the kernels' ``ValueError``) and turns a Python number given where Apex passes a
one-element tensor (``lr``, ``step``, ``inv_scale``, ``global_grad_norm``) into a tensor
(float64 on the CPU, float32 on the noop flag's device for CUDA).

The preconditions on ``chunk_size`` and the scalar arguments (``mode``, ``bias_correction``,
``step`` ...) are one table, :data:`amp_fused_ops._preconditions.PRECONDITIONS`, checked here
once before the kernel or the reference is picked: the same mistake gives the same
``ValueError`` and message on every path. The per-tensor preconditions (list counts and
lengths, sizes, dtypes, layouts, devices, written tensors that share memory with another) are
one C++ header, ``csrc/common/checks.h``, used by the CPU and CUDA kernels, and the reference
raises the same exception with the same words.

``update_scale_hysteresis`` takes no tensor lists: it dispatches on the device of
``current_scale``.

Every path bumps the autograd version counter of each tensor an op writes in place (the
reference through ATen's in-place ops, the compiled kernels in their dispatcher wrappers), so
autograd detects a tensor saved for backward and modified by an op, and caches keyed on
versions (amp O1's weight-cast cache) see the change.

``amp_C`` is a module object, importable both ways::

    from amp_fused_ops import amp_C
    import amp_fused_ops.amp_C
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from amp_fused_ops import _preconditions, _reference
from amp_fused_ops._reference_common import find_wrong_device

__all__ = ["amp_C", "compiled_ops"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

# Device types a compiled extension may exist for.
_EXTENSION_DEVICE_TYPES = ("cpu", "cuda")


@functools.cache
def _loader_get_extension() -> Callable[[str], types.ModuleType | None] | None:
    """``_loader.get_extension``, or None when the loader (or that function) does not exist."""
    try:
        loader = importlib.import_module("amp_fused_ops._loader")
    except ImportError as exc:
        logger.debug("amp_fused_ops._loader unavailable (%s); using the reference ops", exc)
        return None
    get_extension = getattr(loader, "get_extension", None)
    if get_extension is None:
        logger.debug("amp_fused_ops._loader has no get_extension; using the reference ops")
        return None
    return cast(Callable[[str], types.ModuleType | None], get_extension)


def _kernel(name: str, tensor_lists: Sequence[Sequence[Tensor]]) -> Callable[..., Any] | None:
    """The compiled op ``name`` for the device of ``tensor_lists[0][0]``, or None."""
    if not tensor_lists or not tensor_lists[0] or not isinstance(tensor_lists[0][0], Tensor):
        return None
    return _kernel_for(name, tensor_lists[0][0])


def _kernel_for(name: str, tensor: Tensor) -> Callable[..., Any] | None:
    """The compiled op ``name`` for the device of ``tensor``, or None."""
    device_type = tensor.device.type
    if device_type not in _EXTENSION_DEVICE_TYPES:
        return None
    get_extension = _loader_get_extension()
    if get_extension is None:
        return None
    extension = get_extension(device_type)
    if extension is None:
        return None
    return cast(Callable[..., Any] | None, getattr(extension, name, None))


def _dispatching(reference: _F) -> _F:
    """Wrap a reference op into one that prefers the compiled kernel of the same name."""
    name = reference.__name__

    @functools.wraps(reference)
    def op(
        chunk_size: int,
        noop_flag: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        _preconditions.check(name, chunk_size, args, kwargs)
        kernel = _kernel(name, tensor_lists)
        impl = reference if kernel is None else kernel
        return impl(chunk_size, noop_flag, tensor_lists, *args, **kwargs)

    return cast(_F, op)


def _dispatching_scaler(reference: _F) -> _F:
    """As :func:`_dispatching`, for ``update_scale_hysteresis`` (device of its first tensor)."""
    name = reference.__name__

    @functools.wraps(reference)
    def op(current_scale: Tensor, *args: Any, **kwargs: Any) -> Any:
        kernel = _kernel_for(name, current_scale) if isinstance(current_scale, Tensor) else None
        impl = reference if kernel is None else kernel
        return impl(current_scale, *args, **kwargs)

    return cast(_F, op)


class _AmpC(types.ModuleType):
    """The ``amp_C`` namespace: every multi-tensor op, with Apex's names and signatures."""

    # In the order of Apex's csrc/amp_C_frontend.cpp.
    multi_tensor_scale = staticmethod(_dispatching(_reference.multi_tensor_scale))
    multi_tensor_sgd = staticmethod(_dispatching(_reference.multi_tensor_sgd))
    multi_tensor_axpby = staticmethod(_dispatching(_reference.multi_tensor_axpby))
    multi_tensor_l2norm = staticmethod(_dispatching(_reference.multi_tensor_l2norm))
    multi_tensor_l2norm_mp = staticmethod(_dispatching(_reference.multi_tensor_l2norm_mp))
    multi_tensor_l2norm_scale = staticmethod(_dispatching(_reference.multi_tensor_l2norm_scale))
    multi_tensor_unscale_l2norm = staticmethod(_dispatching(_reference.multi_tensor_unscale_l2norm))
    multi_tensor_lamb_stage1_cuda = staticmethod(
        _dispatching(_reference.multi_tensor_lamb_stage1_cuda)
    )
    multi_tensor_lamb_stage2_cuda = staticmethod(
        _dispatching(_reference.multi_tensor_lamb_stage2_cuda)
    )
    multi_tensor_adam = staticmethod(_dispatching(_reference.multi_tensor_adam))
    multi_tensor_adam_capturable = staticmethod(
        _dispatching(_reference.multi_tensor_adam_capturable)
    )
    multi_tensor_adam_capturable_master = staticmethod(
        _dispatching(_reference.multi_tensor_adam_capturable_master)
    )
    multi_tensor_adagrad = staticmethod(_dispatching(_reference.multi_tensor_adagrad))
    multi_tensor_novograd = staticmethod(_dispatching(_reference.multi_tensor_novograd))
    multi_tensor_lamb = staticmethod(_dispatching(_reference.multi_tensor_lamb))
    multi_tensor_lamb_mp = staticmethod(_dispatching(_reference.multi_tensor_lamb_mp))
    update_scale_hysteresis = staticmethod(_dispatching_scaler(_reference.update_scale_hysteresis))

    def __dir__(self) -> list[str]:
        # The ops are attributes of the class, which a module's dir() does not look at: list
        # them, so that help(), dir() and tab completion show every op.
        return sorted(set(super().__dir__()) | set(getattr(self, "__all__", ())))


amp_C = _AmpC(
    "amp_fused_ops.amp_C",
    "Apex-compatible multi-tensor ops; each runs the compiled kernel of the tensors' device "
    "when one is built, else the pure-PyTorch reference.",
)
amp_C.__all__ = list(_reference.__all__)  # type: ignore[attr-defined]
# `import amp_fused_ops.amp_C` finds the namespace without a file of that name.
sys.modules[amp_C.__name__] = amp_C


# --- the compiled ops under Apex's calling convention -------------------------------------

OPS_NAMESPACE = "amp_fused_ops"
"""Namespace of the compiled multi-tensor ops: ``torch.ops.amp_fused_ops``."""

# Op -> the numbers of tensor lists it takes (Apex's layouts; the schema's list arguments, the
# last ones optional when there are fewer).
_LIST_COUNTS: dict[str, tuple[int, ...]] = {
    "multi_tensor_scale": (2,),
    "multi_tensor_axpby": (3,),
    "multi_tensor_l2norm": (1,),
    "multi_tensor_l2norm_mp": (1,),
    "multi_tensor_unscale_l2norm": (1,),
    "multi_tensor_adam": (4,),
    "multi_tensor_adam_capturable": (4,),
    "multi_tensor_adam_capturable_master": (5,),
    "multi_tensor_sgd": (3, 4),
    "multi_tensor_adagrad": (3,),
    "multi_tensor_lamb": (4,),
    "multi_tensor_novograd": (3,),
    "multi_tensor_lamb_stage1_cuda": (5,),
    "multi_tensor_lamb_stage2_cuda": (2,),
}

# Tensor arguments that Apex's callers may give as Python numbers.
_NUMBER_ARGUMENTS = frozenset({"lr", "step", "inv_scale", "global_grad_norm"})

# Ops with no tensor lists: called as they are.
_PLAIN_OPS = ("update_scale_hysteresis",)


def _number_tensor(op: str, name: str, value: Any, noop_flag: Tensor, cpu: bool) -> Any:
    """``value`` as a tensor when it is a Python number (see the module docstring)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, int | float):
        if cpu:
            return torch.tensor(float(value), dtype=torch.float64)
        return torch.full((1,), float(value), dtype=torch.float32, device=noop_flag.device)
    raise TypeError(
        f"{op}: {name} must be a tensor or a number, got {type(value).__name__}; pass a "
        "one-element tensor (or a float)"
    )


def _apex_convention(name: str, overload: Any, cpu: bool) -> Callable[..., Any]:
    """``overload`` (separate list arguments) called as Apex's ``amp_C.<name>``."""
    counts = _LIST_COUNTS[name]
    most = max(counts)
    layouts = f"{' or '.join(map(str, counts))} tensor lists"
    arguments = overload._schema.arguments
    scalars = [argument.name for argument in arguments[2 + most :]]
    numbers = tuple(
        (index, argument)
        for index, argument in enumerate(scalars)
        if argument in _NUMBER_ARGUMENTS and str(arguments[2 + most + index].type) == "Tensor"
    )

    def op(
        chunk_size: int,
        noop_flag: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        given = len(tensor_lists)
        if given not in counts:
            raise ValueError(f"{name}: expected {layouts}, got {given}")
        lists: list[Any] = [*tensor_lists, *([None] * (most - given))]
        if numbers:
            args_list = list(args)
            for index, argument in numbers:
                if index < len(args_list):
                    args_list[index] = _number_tensor(
                        name, argument, args_list[index], noop_flag, cpu
                    )
                elif argument in kwargs:
                    kwargs[argument] = _number_tensor(
                        name, argument, kwargs[argument], noop_flag, cpu
                    )
            args = tuple(args_list)
        try:
            return overload(chunk_size, noop_flag, *lists, *args, **kwargs)
        except NotImplementedError:
            # The dispatcher runs the kernel of the highest-priority device among the tensors;
            # a tensor on a device with no kernel (meta, ...) ends here, before the kernel's
            # own device check: raise that check's error instead.
            wrong = find_wrong_device(name, noop_flag, tensor_lists)
            if wrong is None:
                raise
            raise wrong from None

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``torch.ops.{overload.namespace}.{name}`` with Apex's ``amp_C`` arguments."
    return op


def compiled_ops(
    namespace: str, dispatch_key: str, path: str | Path, *, cpu_scalars: bool
) -> types.ModuleType:
    """The ops of ``torch.ops.<namespace>`` that have a kernel for ``dispatch_key``, as a module.

    Each attribute is one op with Apex's ``amp_C`` signature (see the module docstring).

    Args:
        namespace: The dispatcher namespace (``"amp_fused_ops"``; the emulation build's own).
        dispatch_key: ``"CPU"`` or ``"CUDA"``: only the ops with a kernel for it are listed.
        path: The shared library that registered the kernels (loaded already); the module's
            ``__file__``.
        cpu_scalars: Python numbers become float64 CPU tensors (the C++ CPU kernels), else
            float32 tensors on the device of the noop flag.

    Returns:
        The module of ops.
    """
    module = types.ModuleType(
        f"{namespace}.{dispatch_key.lower()}",
        f"Kernels of torch.ops.{namespace} for {dispatch_key}, with Apex's amp_C signatures.",
    )
    module.__file__ = str(path)
    packets = getattr(torch.ops, namespace)
    for name in (*_LIST_COUNTS, *_PLAIN_OPS):
        qualified = f"{namespace}::{name}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, dispatch_key):
            continue
        overload = getattr(packets, name).default
        if name in _LIST_COUNTS:
            setattr(module, name, _apex_convention(name, overload, cpu_scalars))
        else:
            setattr(module, name, overload)
    return module
