"""The bucket helpers of Apex's ``apex.parallel.distributed`` that training scripts call.

NVIDIA's BERT scripts, for example, broadcast the initial weights with
``flat_dist_call([p.data for p in model.parameters()], torch.distributed.broadcast, (0,))``:
the tensors are grouped by type, each group is flattened into one buffer, the collective runs
once per buffer and the result is copied back. After ``torch.distributed.all_reduce`` the
buffer is divided by the world size (an average), as in Apex.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "apply_flat_dist_call",
    "extract_tensors",
    "flat_dist_call",
    "split_by_type",
    "split_half_float_double",
]

_SPLIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def apply_flat_dist_call(
    bucket: Sequence[Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
) -> None:
    """Run ``call(flat, *extra_args)`` on the tensors of ``bucket`` flattened into one buffer.

    Args:
        bucket: Tensors of one dtype on one device.
        call: A collective such as ``torch.distributed.broadcast`` (or any function of a tensor
            that changes it in place).
        extra_args: Further arguments of ``call`` (e.g. ``(0,)``, the source rank).
    """
    flat = _flatten_dense_tensors(list(bucket))
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat /= dist.get_world_size()
    with torch.no_grad():
        for tensor, synced in zip(
            bucket, _unflatten_dense_tensors(flat, list(bucket)), strict=True
        ):
            tensor.copy_(synced)


def split_by_type(tensors: Iterable[Tensor]) -> dict[str, list[Tensor]]:
    """The tensors grouped by ``tensor.type()`` (dtype and device kind), in first-seen order."""
    buckets: dict[str, list[Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def split_half_float_double(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """The half, bfloat16, float and double tensors as separate non-empty lists, in that order
    (Apex's CUDA-only version knew half, float and double)."""
    buckets = []
    for dtype in _SPLIT_DTYPES:
        bucket = [t for t in tensors if t.dtype == dtype]
        if bucket:
            buckets.append(bucket)
    return buckets


def flat_dist_call(
    tensors: Iterable[Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
) -> None:
    """:func:`apply_flat_dist_call` once per type of tensor (one collective per type).

    Example:
        >>> flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))
    """
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: list[Tensor]) -> None:
    """Append every tensor found in ``maybe_tensor`` (a tensor or nested iterables of them;
    strings are not searched, where Apex recursed without end)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    if isinstance(maybe_tensor, (str, bytes)):
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)
