"""The autocast rules of the registry's entries: their ``AutocastCPU`` / ``AutocastCUDA`` kernels.

Each entry of the op registry names what ``torch.autocast`` does to its op (its ``autocast``
attribute):

``None``
    Nothing: the op runs in its tensors' dtypes (its autocast keys fall through). The
    multi-tensor ops are such: they write their tensors in place, which a cast would redirect
    to copies, and the SyncBN ops, which the SyncBatchNorm module calls with its own dtypes.
``"lower_precision"``
    The op's floating-point tensor arguments (float32, float16, bfloat16) on the autocast
    device are cast to the autocast dtype, and the op runs on the casts, as ``torch.autocast``
    does for its lower-precision ops (matmuls, convolutions). The fused norms' forward is such,
    as Apex's fused norms were under ``torch.autocast``: output in the autocast dtype, float32
    statistics inside. The casts are recorded by autograd, so float32 parameters get float32
    gradients. float64 tensors and tensors on another device are left alone.

amp O1 has its own rule for the fused norms, as for ATen's ops (``layer_norm`` is an fp32 op of
Apex's policy): amp-core's policy table names ``amp_fused_ops::norm_forward`` and registers its
kernel over this one while O1 casting is on. Nothing here asks amp-core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["AUTOCAST_RULES", "register_autocast_kernels"]

AUTOCAST_RULES = (None, "lower_precision")
"""The values an entry's ``autocast`` may take."""

_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# One library per namespace, kept alive for the life of the process: dropping it would remove
# the registrations.
_libraries: dict[str, torch.library.Library] = {}


def _lower_precision_kernel(op: Any, device_type: str, key: str) -> Callable[..., Any]:
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def cast(value: Any, dtype: torch.dtype) -> Any:
        if (
            isinstance(value, Tensor)
            and value.dtype in _CAST_DTYPES
            and value.device.type == device_type
        ):
            return value.to(dtype)
        return value

    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype(device_type)
        args = tuple(cast(a, dtype) for a in args)
        kwargs = {name: cast(value, dtype) for name, value in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return kernel


def register_autocast_kernels(entries: Iterable[Any], namespace: str) -> None:
    """Register the autocast kernels of ``entries`` (registry entries: ``name``, ``autocast``)
    in ``torch.ops.<namespace>``, once per namespace."""
    if namespace in _libraries:
        return
    library = torch.library.Library(namespace, "IMPL")
    packets = getattr(torch.ops, namespace)
    for entry in entries:
        if entry.autocast is None:
            continue
        op = getattr(packets, entry.name).default
        for device_type, key in _AUTOCAST_KEYS.items():
            library.impl(entry.name, _lower_precision_kernel(op, device_type, key), key)
    _libraries[namespace] = library
