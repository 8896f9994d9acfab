"""Flatten a list of tensors into one buffer and back (Apex's ``apex_C.flatten``/``unflatten``).

Used to bucket gradients and parameters into one message per collective. :func:`flatten`
is one ``torch.cat`` (one copy kernel on CUDA); :func:`unflatten` returns views into the
buffer, so it copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate dense tensors of one device and dtype into a new 1-D tensor.

    Args:
        tensors: The tensors, in order; any shapes, all of one device and dtype.

    Returns:
        A new contiguous 1-D tensor holding every element of ``tensors`` in order (a copy
        even for a single tensor).

    Raises:
        ValueError: If ``tensors`` is empty, or mixes devices, dtypes or sparse layouts.

    Example:
        >>> flat = flatten([torch.ones(2, 3), torch.zeros(4)])
        >>> flat.shape
        torch.Size([10])
    """
    if len(tensors) == 0:
        raise ValueError("flatten needs at least one tensor, got an empty list")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ValueError(f"flatten takes dense tensors; tensor {i} has layout {t.layout}")
        if t.device != first.device or t.dtype != first.dtype:
            raise ValueError(
                f"flatten takes tensors of one device and dtype: tensor 0 is {first.dtype} on "
                f"{first.device}, tensor {i} is {t.dtype} on {t.device}; group them first"
            )
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into views shaped like ``tensors`` (the inverse of :func:`flatten`).

    Args:
        flat: A 1-D tensor with exactly as many elements as ``tensors`` together.
        tensors: The tensors whose shapes to take, in order.

    Returns:
        Views of ``flat``, one per tensor, with its shape.

    Raises:
        ValueError: If ``flat`` is not 1-D or its size is not the total size of ``tensors``.

    Example:
        >>> like = [torch.ones(2, 3), torch.zeros(4)]
        >>> [t.shape for t in unflatten(flatten(like), like)]
        [torch.Size([2, 3]), torch.Size([4])]
    """
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(
            f"unflatten expects a 1-D tensor of {total} elements (the total size of the "
            f"{len(tensors)} tensors), got shape {tuple(flat.shape)}; pass flatten(tensors)"
        )
    views: list[Tensor] = []
    offset = 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    return views
