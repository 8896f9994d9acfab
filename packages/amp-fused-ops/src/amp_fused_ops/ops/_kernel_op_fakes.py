"""Fake kernels of the ops the CUDA extension defines outside the registry (norm and SyncBN).

``csrc/cuda/layer_norm.cu`` and ``csrc/cuda/syncbn.cu`` define their own dispatcher ops
(``torch.ops.amp_fused_ops_cuda_ops``; ``amp_fused_ops_emu_ops`` in the emulated build) with
``TORCH_LIBRARY_FRAGMENT``, for the CUDA key only. :func:`register_fakes` gives each of them a
fake kernel once its library is loaded, so that they work on fake and meta tensors (the output
shapes and dtypes of the real kernels) and pass ``torch.library.opcheck``, as the registry's
ops do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["CUDA_NAMESPACE", "EMULATED_NAMESPACE", "FAKES", "register_fakes"]

CUDA_NAMESPACE = "amp_fused_ops_cuda_ops"
"""Namespace of the norm and SyncBN ops of the CUDA extension."""
EMULATED_NAMESPACE = "amp_fused_ops_emu_ops"
"""The same ops in the emulated build (``csrc/emulation/amp_emu.h`` renames the namespace)."""


def _channels(x: Tensor, channel_last: bool) -> int:
    return x.shape[-1] if channel_last else x.shape[1]


def _per_channel(x: Tensor, channels: int) -> Tensor:
    return x.new_empty((channels,), dtype=torch.float32)


def _welford_mean_var(x: Tensor, channel_last: bool) -> tuple[Tensor, Tensor]:
    channels = _channels(x, channel_last)
    return _per_channel(x, channels), _per_channel(x, channels)


def _welford_parallel(
    means: Tensor, vars_biased: Tensor, counts: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    channels = means.shape[1]
    return tuple(_per_channel(means, channels) for _ in range(3))  # type: ignore[return-value]


def _forward(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    z: Tensor | None,
    fuse_relu: bool,
    channel_last: bool,
) -> Tensor:
    return torch.empty_like(x)


def _reduce(dy: Tensor, x: Tensor, mean: Tensor, channel_last: bool) -> tuple[Tensor, Tensor]:
    channels = _channels(x, channel_last)
    return _per_channel(x, channels), _per_channel(x, channels)


def _backward(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: int,
    channel_last: bool,
) -> Tensor:
    return torch.empty_like(x)


def _layer_norm_fwd(
    x: Tensor, gamma: Tensor | None, beta: Tensor | None, eps: float, rms: bool, mixed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    present = gamma if gamma is not None else beta
    param_dtype = present.dtype if present is not None else x.dtype
    rows = x.shape[0]
    y = torch.empty_like(x, dtype=param_dtype if mixed else x.dtype)
    return y, x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


def _layer_norm_bwd(
    dy: Tensor,
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    gamma: Tensor | None,
    beta: Tensor | None,
    rms: bool,
    memory_efficient: bool,
    input_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    dx = torch.empty_like(dy, dtype=input_dtype)
    dgamma = torch.empty_like(gamma) if gamma is not None else dy.new_empty((0,))
    dbeta = torch.empty_like(beta) if beta is not None else dy.new_empty((0,))
    return dx, dgamma, dbeta


FAKES: dict[str, Callable[..., Any]] = {
    "syncbn_welford_mean_var": _welford_mean_var,
    "syncbn_welford_parallel": _welford_parallel,
    "syncbn_forward": _forward,
    "syncbn_reduce": _reduce,
    "syncbn_backward": _backward,
    "layer_norm_fwd": _layer_norm_fwd,
    "layer_norm_bwd": _layer_norm_bwd,
}
"""Op name -> its fake kernel: the real kernel's output shapes and dtypes, no data."""

_registered: dict[str, torch.library.Library] = {}


def register_fakes(namespace: str) -> None:
    """Register the fake kernel of every op of :data:`FAKES` that ``namespace`` defines.

    Called once the library that defines the ops is loaded (the CUDA extension, or the
    emulated build); later calls for the same namespace do nothing.

    Args:
        namespace: ``"amp_fused_ops_cuda_ops"``, or the emulated build's
            ``"amp_fused_ops_emu_ops"``.
    """
    if namespace in _registered:
        return
    library = torch.library.Library(namespace, "FRAGMENT")
    packets = getattr(torch.ops, namespace)
    for name, fake in FAKES.items():
        if hasattr(packets, name):
            torch.library.register_fake(f"{namespace}::{name}", fake, lib=library)
    _registered[namespace] = library
