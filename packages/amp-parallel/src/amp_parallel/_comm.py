"""Communication helpers shared by DDP, Reducer and SyncBatchNorm.

Everything here runs on ``torch.distributed`` collectives (Gloo on CPU, NCCL on CUDA). The
flatten/unflatten pair is the single dispatch point for amp-fused-ops' ``flatten`` /
``unflatten`` (Apex's ``apex_C``): used when ``amp_fused_ops`` is installed (the ``kernels``
extra), PyTorch's ``torch._utils`` pair otherwise. Both give the same buffers and views.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "ProcessGroup",
    "broadcast_tensors",
    "flatten",
    "group_by_device_dtype",
    "require_initialized",
    "unflatten",
]

log = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


def require_initialized(who: str) -> None:
    """Raise a ``RuntimeError`` that gives the fix when no default process group exists.

    Args:
        who: The name of the calling API, used in the message.

    Raises:
        RuntimeError: If ``torch.distributed`` is unavailable or not initialized.
    """
    if not dist.is_available():
        raise RuntimeError(
            f"{who} needs torch.distributed, which this PyTorch build does not provide. "
            "Install a PyTorch build with distributed support."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs an initialized default process group. Call "
            "torch.distributed.init_process_group(backend='nccl' or 'gloo') first "
            "(torchrun sets the rendezvous environment variables for you)."
        )


FlattenPair = tuple[
    Callable[[Sequence[Tensor]], Tensor], Callable[[Tensor, Sequence[Tensor]], list[Tensor]]
]


@functools.cache
def fused_flatten() -> FlattenPair | None:
    """amp-fused-ops' ``(flatten, unflatten)`` when it is installed, else ``None``."""
    try:
        from amp_fused_ops import flatten as fused
        from amp_fused_ops import unflatten as fused_un
    except ImportError:
        return None
    return fused, fused_un


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate dense tensors of one device and dtype into a new 1-D tensor.

    Always a copy, also for a single tensor. Uses amp-fused-ops' ``flatten`` when installed.
    """
    fused = fused_flatten()
    if fused is not None and len(tensors) > 0:
        return fused[0](tensors)
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into views shaped like ``like`` (inverse of :func:`flatten`)."""
    fused = fused_flatten()
    if fused is not None:
        return fused[1](flat, like)
    return list(_unflatten_dense_tensors(flat, list(like)))


def group_by_device_dtype(
    tensors: Iterable[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """Group tensors by ``(device, dtype)``, keeping their order inside each group."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return dict(groups)


def broadcast_tensors(
    tensors: Iterable[Tensor], src: int = 0, group: ProcessGroup | None = None
) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, one message per device/dtype.

    Args:
        tensors: Tensors to overwrite with ``src``'s values (``.data`` of parameters, buffers).
        src: Global rank that sends.
        group: Process group; the default group when ``None``.
    """
    with torch.no_grad():
        for same in group_by_device_dtype(tensors).values():
            flat = flatten(same)
            dist.broadcast(flat, src=src, group=group)
            for t, synced in zip(same, unflatten(flat, same), strict=True):
                t.copy_(synced)
