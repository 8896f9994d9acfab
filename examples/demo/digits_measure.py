"""What the digits demo measures: step-time statistics and the memory a level holds.

Kept apart from the training script so that each measurement can be read (and tested) alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

# --------------------------------------------------------------------------- memory

StorageKey = tuple[str, int, int]  # (device type, device index, data pointer)


def storage_key(tensor: Tensor) -> StorageKey:
    """Identifies the memory a tensor lives in: views and aliases of one storage share it."""
    index = tensor.device.index if tensor.device.index is not None else -1
    return (tensor.device.type, index, tensor.untyped_storage().data_ptr())


@dataclass(frozen=True)
class HeldMemory:
    """Bytes a training setup holds between steps, each storage counted once.

    Attributes:
        weights: the model's parameters and buffers, plus parameters the optimizer steps that
            are not the model's (amp's fp32 master weights under O2).
        grads: the ``.grad`` of all of those.
        optimizer_state: the tensors in ``optimizer.state`` (Adam's moments and step counts).
    """

    weights: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_state


class _StorageCounter:
    """Sums the bytes of storages not seen before."""

    def __init__(self) -> None:
        self.seen: set[StorageKey] = set()

    def count(self, tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                continue
            key = storage_key(tensor)
            if key in self.seen:
                continue
            self.seen.add(key)
            total += tensor.untyped_storage().nbytes()
        return total


def held_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[HeldMemory, set]:
    """Count what ``model`` and ``optimizer`` hold now (call it after a step).

    Every tensor is reached through the objects themselves, so the figure is what is really
    allocated, not a formula: a parameter the model and the optimizer share is counted once,
    and a master copy that the optimizer steps in place of a half-precision model parameter is
    counted as a weight of its own.

    Returns:
        The counts, and the keys of every storage counted (to tell activations apart from
        weights when counting what autograd saves).
    """
    counter = _StorageCounter()
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    params = [*model.parameters(), *stepped]
    weights = counter.count([*params, *model.buffers()])
    grads = counter.count(p.grad for p in params)
    state = counter.count(v for s in optimizer.state.values() for v in s.values())
    return HeldMemory(weights, grads, state), set(counter.seen)


class SavedForBackward:
    """Bytes of the tensors autograd saves for backward while the context is active.

    A ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor a forward pass keeps
    for its backward; storages in ``exclude`` (the weights, already counted as held memory) and
    storages seen before are not counted. Low-precision copies of fp32 weights that O1 makes
    for its matrix products are counted: they are held until the backward is done.
    """

    def __init__(self, exclude: set[StorageKey]) -> None:
        self.bytes = 0
        self._seen = set(exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(kind, value, traceback)


# --------------------------------------------------------------------------- step time


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range of a sample."""

    median: float
    q1: float
    q3: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of needs at least one value, got an empty sequence")
        if len(values) == 1:
            return cls(values[0], values[0], values[0])
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, q1, q3)

    def excludes_one(self) -> bool:
        """Whether the whole interquartile range lies on one side of 1.0 (for ratios)."""
        return self.q3 < 1.0 or self.q1 > 1.0


@dataclass(frozen=True)
class LevelTiming:
    """Step time of one level over the timed rounds.

    Attributes:
        step_ms: the level's own time per step, in milliseconds.
        ratio: time per step divided by the baseline's in the same round.
    """

    level: str
    step_ms: Spread
    ratio: Spread

    @property
    def verdict(self) -> str:
        """``faster`` / ``slower`` than the baseline, or ``~`` when the IQR contains 1.0."""
        if not self.ratio.excludes_one():
            return "~"
        return "faster" if self.ratio.q3 < 1.0 else "slower"


def summarize_rounds(
    rounds: Sequence[Mapping[str, float]], baseline: str
) -> dict[str, LevelTiming]:
    """Per-level step time and per-round ratio to ``baseline``.

    Args:
        rounds: one mapping per round, level -> seconds per step in that round's block.
        baseline: the level the ratios divide by (O0 when it ran).
    """
    levels = list(rounds[0])
    return {
        level: LevelTiming(
            level,
            Spread.of([r[level] * 1e3 for r in rounds]),
            Spread.of([r[level] / r[baseline] for r in rounds]),
        )
        for level in levels
    }


def unresolved_pairs(rounds: Sequence[Mapping[str, float]]) -> list[tuple[str, str]]:
    """Pairs of levels whose per-round time ratio has an interquartile range containing 1.0.

    Those pairs cannot be ranked from this run: the machine's noise is as large as their
    difference.
    """
    return [
        (a, b)
        for a, b in combinations(list(rounds[0]), 2)
        if not Spread.of([r[a] / r[b] for r in rounds]).excludes_one()
    ]
