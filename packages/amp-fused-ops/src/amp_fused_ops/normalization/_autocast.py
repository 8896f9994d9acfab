"""The fused norm ops under autocast: the kernels of the ``AutocastCPU`` / ``AutocastCUDA`` keys.

Under ``torch.autocast``, ``norm_forward`` does what Apex's fused norms did (inputs and
parameters in the autocast dtype); under amp O1 it follows ``layer_norm`` (half inputs in
fp32). Registered when :mod:`amp_fused_ops.normalization` is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops import _kernel_ops  # noqa: F401  (defines the op registered below)

__all__ = ["layer_norm_autocasts_to_fp32"]

_HALF = (torch.float16, torch.bfloat16)
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- autocast ---------------------------------------------------------------------------------

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def layer_norm_autocasts_to_fp32(device_type: str) -> bool:
    """Whether autocast runs ``layer_norm`` in fp32 on ``device_type``.

    True where the dispatcher holds an autocast kernel for ``aten::layer_norm`` on that device:
    PyTorch's own on CUDA, and amp O1's (amp_core registers one per device while O1 casting is
    on). PyTorch's CPU autocast has none and leaves ``layer_norm`` in the input's dtype.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (other devices: False).

    Returns:
        Whether the fused norms should cast half inputs to fp32 under autocast there.
    """
    key = _AUTOCAST_KEYS.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::layer_norm", key
    )


def _to_fp32(t: Tensor | None, device_type: str) -> Tensor | None:
    if t is not None and t.dtype in _HALF and t.device.type == device_type:
        return t.float()
    return t


def _to_autocast_dtype(t: Tensor | None, dtype: torch.dtype, device_type: str) -> Tensor | None:
    # As torch.autocast's own casts (and Apex's): float64 and other devices are left alone.
    if t is not None and t.dtype in _NATIVE_DTYPES and t.device.type == device_type:
        return t.to(dtype)
    return t


@functools.cache
def _o1_casting_check() -> Callable[[], bool] | None:
    """amp-core's public ``o1_casting_active``, or ``None`` where amp-core is not installed.

    amp-core is optional for this package: imported on the first autocast call of a fused
    norm, not when this package is imported.
    """
    try:
        from amp_core import o1_casting_active
    except ImportError:
        return None
    return o1_casting_active


def _amp_o1_active() -> bool:
    """Whether amp O1 casting is on for this thread (never, where amp-core is not installed)."""
    check = _o1_casting_check()
    return check is not None and bool(check())


def _autocast_kernel(device_type: str, key: str) -> Any:
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
        rms: bool,
        mixed: bool,
        memory_efficient: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if _amp_o1_active():
            # amp O1: Apex's policy runs layer_norm in fp32, and so do the fused norms.
            if layer_norm_autocasts_to_fp32(device_type):
                x = _to_fp32(x, device_type)  # type: ignore[assignment]
                weight = _to_fp32(weight, device_type)
                bias = _to_fp32(bias, device_type)
        else:
            # torch.autocast: as Apex, inputs and parameters in the autocast dtype (the casts
            # are recorded by autograd, so float32 parameters get float32 gradients).
            dtype = torch.get_autocast_dtype(device_type)
            x = _to_autocast_dtype(x, dtype, device_type)  # type: ignore[assignment]
            weight = _to_autocast_dtype(weight, dtype, device_type)
            bias = _to_autocast_dtype(bias, dtype, device_type)
        with torch._C._ExcludeDispatchKeyGuard(below):
            return torch.ops.amp_fused_ops.norm_forward.default(
                x, weight, bias, eps, rms, mixed, memory_efficient
            )

    return kernel


# Kept alive for the life of the process: dropping the library removes the registrations.
_autocast_lib = torch.library.Library("amp_fused_ops", "IMPL")
for _device_type, _key in _AUTOCAST_KEYS.items():
    _autocast_lib.impl("norm_forward", _autocast_kernel(_device_type, _key), _key)
