"""The two ways amp steps an optimizer: the ordinary path and the fused master-weight path.

Both sit behind :class:`StepPath`, used by :class:`~amp_core._optimizer.OptimizerAmpState`,
which owns the stage of the step and passes each call what it needs as arguments.

* :class:`OrdinaryPath`: amp keeps the float32 masters in the optimizer's param groups (under
  O2), the gradients are unscaled into place at ``scale_loss`` exit, and ``step()`` reads the
  overflow flag, then steps the optimizer and copies the masters into the model.
* :class:`FusedPath`: the optimizer implements
  :class:`~amp_core._fused_master.FusedMasterWeightOptimizer` and keeps the masters itself. A
  backward's gradients may stay scaled until ``step()``, which unscales, checks, steps and
  writes the model in one pass (see :func:`~amp_core._master_step.fused_master_step`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._master_step import fused_master_step
from ._master_weights import HALF_DTYPES, MasterWeights, match_state_dtypes
from ._scaler import LossScaler

__all__ = [
    "CLOSURE_UNSUPPORTED",
    "Deferred",
    "FusedPath",
    "OrdinaryPath",
    "OverflowReader",
    "StepOutcome",
    "StepPath",
]

CLOSURE_UNSUPPORTED = (
    "Currently, Amp does not support closure use with optimizers. Compute the loss and run "
    "its backward inside `with amp.scale_loss(loss, optimizer)`, then call optimizer.step() "
    "without a closure."
)

# Reads an overflow flag back to the host (the one sync of a step), given the loss ids whose
# scalers set it; True when the step must be skipped.
OverflowReader = Callable[[Tensor, list[int]], bool]


@dataclass(frozen=True)
class Deferred:
    """A backward whose scaled gradients wait for the fused step."""

    scaler: LossScaler
    loss_id: int
    check: bool
    version: int  # the scaler's update count when the gradients took its scale


@dataclass
class StepOutcome:
    """What a path's ``step`` did."""

    result: Any = None
    skipped: bool = False  # skipped for an overflow read on the host
    checks: list[tuple[int, Tensor]] = field(default_factory=list)  # the flags that skipped it
    stale_inv_scale: Tensor | None = None  # the grads it read are still scaled by this
    device_skip: Tensor | None = None  # 1 when skipped on the device without a read-back


def combined_flag(checks: list[tuple[int, Tensor]]) -> Tensor | None:
    """The sum of the noted overflow flags (nonzero on any overflow), or None for none."""
    total: Tensor | None = None
    for _, flag in checks:
        total = flag if total is None else total + flag
    return total


def _state_follows_param_dtype(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps a param with state of the param's dtype only: torch's own
    optimizers do (their ``load_state_dict`` casts state so); the toolkit's fused optimizers
    keep float32 state for half params and are left alone."""
    return type(optimizer).__module__.split(".")[:2] == ["torch", "optim"]


class StepPath(abc.ABC):
    """How one optimizer's masters are made and its step is taken.

    Args:
        optimizer: The optimizer.
        weights: Its masters and directly stepped params (filled by :meth:`adopt_group`).
    """

    fused: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer, weights: MasterWeights) -> None:
        self.optimizer = optimizer
        self.weights = weights

    @abc.abstractmethod
    def adopt_groups(
        self, groups: list[dict[str, Any]], sources: dict[Any, Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        """Take over param groups; return their new ``(model_param, master)`` pairs.

        Args:
            groups: Param groups of the optimizer not taken over yet.
            sources: Full-precision values of params the model cast just now.
        """

    def may_defer(self) -> bool:
        """Whether a backward's gradients may stay scaled until ``step()``."""
        return False

    @abc.abstractmethod
    def step(
        self,
        original_step: Callable[..., Any],
        closure: Callable[[], Any] | None,
        deferred: Deferred | None,
        checks: list[tuple[int, Tensor]],
        read_overflow: OverflowReader,
    ) -> StepOutcome:
        """Step (or skip) with the noted overflow ``checks`` or the ``deferred`` backward."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Undo what the path did to the optimizer: the model params, holding their masters'
        values as float32, are what it steps afterwards."""


class OrdinaryPath(StepPath):
    """Masters (if any) in the param groups; gradients unscaled before ``step()``.

    Args:
        optimizer: The optimizer.
        weights: Its masters and direct params.
        master_weights: Whether half params get float32 masters.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, weights: MasterWeights, master_weights: bool
    ) -> None:
        super().__init__(optimizer, weights)
        self.master_weights = master_weights

    def adopt_groups(
        self, groups: list[dict[str, Any]], sources: dict[Any, Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        pairs = []
        for group in groups:
            if self.master_weights:
                pairs += self.weights.adopt_group(group, self.optimizer.state, sources)
            else:
                self.weights.direct_params.extend(group["params"])
                if _state_follows_param_dtype(self.optimizer):
                    # Params O3 cast: their existing state follows (as a torch load casts it).
                    half = [p for p in group["params"] if p.dtype in HALF_DTYPES]
                    match_state_dtypes(self.optimizer.state, half)
        return pairs

    def step(
        self,
        original_step: Callable[..., Any],
        closure: Callable[[], Any] | None,
        deferred: Deferred | None,
        checks: list[tuple[int, Tensor]],
        read_overflow: OverflowReader,
    ) -> StepOutcome:
        assert deferred is None  # only the fused path defers
        found_inf = combined_flag(checks)
        overflow = found_inf is not None and read_overflow(found_inf, [i for i, _ in checks])
        if overflow and closure is not None:
            raise RuntimeError(CLOSURE_UNSUPPORTED)

        def run() -> Any:
            return original_step() if closure is None else original_step(closure)

        result = self.weights.step(run, overflow=overflow)
        return StepOutcome(result, skipped=overflow, checks=checks if overflow else [])

    def remove(self) -> None:
        self.weights.release(self.optimizer)


class FusedPath(StepPath):
    """The optimizer keeps the masters and steps them in one fused pass."""

    fused = True

    def __init__(self, optimizer: Any, weights: MasterWeights) -> None:
        super().__init__(optimizer, weights)

    def adopt_groups(
        self, groups: list[dict[str, Any]], sources: dict[Any, Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        # The optimizer makes masters for the half params that have none yet.
        made = self.optimizer.amp_enable_fused_master_weights(sources)  # type: ignore[attr-defined]
        by_param = {id(p): m for p, m in made}
        pairs = []
        for group in groups:
            for param in group["params"]:
                if id(param) in by_param:
                    self.weights.add_pair(param, by_param[id(param)])
                    pairs.append((param, by_param[id(param)]))
                else:
                    self.weights.direct_params.append(param)
        return pairs

    def may_defer(self) -> bool:
        # Only when no unscaled gradient is in place: the fused step reads them all scaled.
        return not self.weights.has_set_aside_grads() and all(
            m.grad is None for m in self.weights.masters
        )

    def settle_stale_grads(self, inv_scale: Tensor) -> None:
        """Unscale, into place, the gradients a fused step read scaled and nobody zeroed, as the
        ordinary path leaves them (the half grads go to the masters' ``.grad``)."""
        with torch.no_grad():
            for p in self.weights.direct_params:
                if p.grad is not None:
                    p.grad.mul_(inv_scale.to(p.grad.device))
            for p, master in self.weights.pairs():
                if p.grad is None:
                    continue
                grad = p.grad.float() * inv_scale.to(p.grad.device)
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None

    def step(
        self,
        original_step: Callable[..., Any],
        closure: Callable[[], Any] | None,
        deferred: Deferred | None,
        checks: list[tuple[int, Tensor]],
        read_overflow: OverflowReader,
    ) -> StepOutcome:
        if closure is not None:
            raise RuntimeError(CLOSURE_UNSUPPORTED)
        self.weights.take_model_edits()
        outcome = self._step(deferred, checks, read_overflow)
        self.weights.note_model_versions()  # the fused step wrote the model
        return outcome

    def _step(
        self,
        deferred: Deferred | None,
        checks: list[tuple[int, Tensor]],
        read_overflow: OverflowReader,
    ) -> StepOutcome:
        optimizer: Any = self.optimizer
        if deferred is None:  # grads already unscaled into place (or none at all)
            found_inf = combined_flag(checks)
            if found_inf is not None and read_overflow(found_inf, [i for i, _ in checks]):
                return StepOutcome(skipped=True, checks=checks)
            device = self._any_device()
            if device is not None:
                fused_master_step(optimizer, None, device)
            return StepOutcome()
        scaler = deferred.scaler
        device = scaler.device or self._any_device() or torch.device("cpu")
        # Reads the scaled grads, unscales, checks, steps the masters, writes the model.
        found_inf, inv_scale = fused_master_step(optimizer, scaler, device)
        if not (deferred.check and scaler.dynamic):
            # A static scale reads nothing back, but the fused step still skipped an overflow
            # on the device: count it there.
            skipped = (found_inf != 0).to(torch.int64)
            return StepOutcome(stale_inv_scale=inv_scale, device_skip=skipped)
        overflow = read_overflow(found_inf, [deferred.loss_id])  # the one host sync of a step
        checks = [(deferred.loss_id, found_inf)] if overflow else []
        return StepOutcome(skipped=overflow, checks=checks, stale_inv_scale=inv_scale)

    def _any_device(self) -> torch.device | None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return p.device
        return None

    def remove(self) -> None:
        # The optimizer is told to drop its masters after the model params took their values.
        self.weights.release(self.optimizer)
        self.optimizer.amp_disable_fused_master_weights()  # type: ignore[attr-defined]
