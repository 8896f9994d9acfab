"""The fused norm op under ``torch.autocast``: its ``AutocastCPU`` / ``AutocastCUDA`` kernels.

Under ``torch.autocast``, ``norm_forward`` does what Apex's fused norms did: the input and the
parameters (float32 / float16 / bfloat16) are cast to the autocast dtype, and the output is in
it (fp32 statistics inside). Registered when :mod:`amp_fused_ops.normalization` is imported.

amp O1 has its own rule for the op, as for ATen's (the fused norms follow ``layer_norm``, an
fp32 op of Apex's policy): amp-core's policy table names ``amp_fused_ops::norm_forward`` and
registers its autocast kernel over this one while O1 casting is on. Nothing here asks amp-core.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops import _kernel_ops  # noqa: F401  (defines the op registered below)

__all__: list[str] = []

_NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _to_autocast_dtype(t: Tensor | None, dtype: torch.dtype, device_type: str) -> Tensor | None:
    # As torch.autocast's own casts (and Apex's): float64 and other devices are left alone.
    if t is not None and t.dtype in _NATIVE_DTYPES and t.device.type == device_type:
        return t.to(dtype)
    return t


def _autocast_kernel(device_type: str, key: str) -> object:
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
        # As Apex: inputs and parameters in the autocast dtype (the casts are recorded by
        # autograd, so float32 parameters get float32 gradients).
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
