"""Apex's ``Reducer``: all-reduce (average) gradients when *you* call :meth:`Reducer.reduce`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._comm import (
    ProcessGroup,
    broadcast_tensors,
    flatten,
    group_by_device_dtype,
    require_initialized,
    unflatten,
)

__all__ = ["Reducer"]

log = logging.getLogger(__name__)


def _collect(tensors: Tensor | Iterable[object], out: list[Tensor]) -> None:
    if isinstance(tensors, Tensor):
        out.append(tensors)
        return
    for item in tensors:
        if isinstance(item, Tensor):
            out.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, str | bytes):
            _collect(item, out)
        else:
            raise TypeError(
                "Reducer expects a module or (nested) lists of tensors, found "
                f"{type(item).__name__}."
            )


class Reducer:
    """All-reduce and average gradients on demand (no hooks, no overlap).

    With a module, its parameters are broadcast from rank 0 at construction and
    :meth:`reduce` averages the ``.grad`` of every parameter that has one. With a (nested)
    list of tensors, :meth:`reduce` averages those tensors in place.

    Args:
        module_or_grads_list: An ``nn.Module`` or a (nested) list of gradient tensors.
        process_group: Keyword-only. Group to reduce over; the default group when ``None``.

    Raises:
        RuntimeError: If no process group is initialized.

    Example:
        >>> reducer = Reducer(model)
        >>> loss.backward()
        >>> reducer.reduce()  # gradients are now the average over ranks
        >>> optimizer.step()
    """

    def __init__(
        self,
        module_or_grads_list: nn.Module | Iterable[Tensor],
        *,
        process_group: ProcessGroup | None = None,
    ) -> None:
        require_initialized("amp_parallel.Reducer")
        self.process_group = process_group
        self.module: nn.Module | None
        self.grads: list[Tensor] = []
        if isinstance(module_or_grads_list, nn.Module):
            self.module = module_or_grads_list
            broadcast_tensors(
                [p.data for p in self.module.parameters()], src=0, group=process_group
            )
        else:
            self.module = None
            _collect(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """Average the gradients (or the tensors given at construction) across ranks."""
        if self.module is not None:
            tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            tensors = self.grads
        world = dist.get_world_size(self.process_group)
        with torch.no_grad():
            for same in group_by_device_dtype(tensors).values():
                flat = flatten(same)
                dist.all_reduce(flat, group=self.process_group)
                flat.div_(world)
                for t, reduced in zip(same, unflatten(flat, same), strict=True):
                    t.copy_(reduced)
