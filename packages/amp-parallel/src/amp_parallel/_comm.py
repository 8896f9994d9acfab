"""Communication helpers shared by DDP, Reducer and SyncBatchNorm.

Everything here runs on ``torch.distributed`` collectives (Gloo on CPU, NCCL on CUDA). The
flatten/unflatten pair is the single dispatch point where amp-fused-ops kernels (multi-tensor
flatten, Apex's ``flatten``/``unflatten`` extension) can plug in later; today it is PyTorch's
``torch._utils`` implementation on every device.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence

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


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate dense tensors of one device and dtype into one 1-D tensor.

    Dispatch point for a fused flatten kernel (amp-fused-ops); PyTorch's path for now.
    """
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into views shaped like ``like`` (inverse of :func:`flatten`)."""
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
