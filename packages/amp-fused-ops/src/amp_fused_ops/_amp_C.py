"""``amp_C``: Apex's namespace of multi-tensor ops, dispatched to a kernel or the reference.

Each op looks at the device of the first tensor of ``tensor_lists[0]`` and asks
``amp_fused_ops._loader.get_extension("cpu" | "cuda")`` for the compiled extension of that
device. When the extension is loaded and has an attribute of the op's name, that kernel runs
with exactly the arguments given; otherwise (no loader, no extension, op not compiled, another
device type, empty lists) the pure-PyTorch reference in :mod:`amp_fused_ops._reference` runs.

The preconditions on ``chunk_size`` and the scalar arguments (``mode``, ``bias_correction``,
``step`` ...) are one table, :data:`amp_fused_ops._preconditions.PRECONDITIONS`, checked here
once before the kernel or the reference is picked: the same mistake gives the same
``ValueError`` and message on every path. The per-tensor preconditions (sizes, dtypes, layouts,
devices) are checked by each path, with the same exception types.

``update_scale_hysteresis`` takes no tensor lists: it dispatches on the device of
``current_scale``.

Every path bumps the autograd version counter of each tensor an op writes in place (the
reference through ATen's in-place ops, the compiled extensions in their bindings), so autograd
detects a tensor saved for backward and modified by an op, and caches keyed on versions (amp
O1's weight-cast cache) see the change.

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
from typing import Any, TypeVar, cast

from torch import Tensor

from amp_fused_ops import _preconditions, _reference

__all__ = ["amp_C"]

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


amp_C = _AmpC(
    "amp_fused_ops.amp_C",
    "Apex-compatible multi-tensor ops; each runs the compiled kernel of the tensors' device "
    "when one is built, else the pure-PyTorch reference.",
)
amp_C.__all__ = list(_reference.__all__)  # type: ignore[attr-defined]
# `import amp_fused_ops.amp_C` finds the namespace without a file of that name.
sys.modules[amp_C.__name__] = amp_C
