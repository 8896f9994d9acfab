"""What ``amp.initialize`` does to an optimizer: master weights, unscaling, skipped steps.

All of it is recorded on the optimizer's :class:`OptimizerAmpState` (``optimizer._amp_state``).
``optimizer.step``, ``optimizer.zero_grad`` and ``optimizer.add_param_group`` are wrapped on
the instance (:mod:`amp_core._optimizer_patch`: Apex's contract needs a step that can be skipped,
which no PyTorch hook offers, and a group added later needs the same treatment as the first
ones); :meth:`OptimizerAmpState.remove` restores them.

Where the optimizer is in its step (a :class:`Stage`, with the table of its transitions) and
what an ``amp.scale_loss`` block does to the gradients is
:class:`~amp_core._step_stages.StepStages`, which :class:`OptimizerAmpState` extends with the
step, ``zero_grad``, ``add_param_group`` and ``amp.close()``.

How masters are kept and the step is taken is a :class:`~amp_core._step_paths.StepPath`: the
ordinary one, or the fused master-weight one for an optimizer that implements
:class:`~amp_core._fused_master.FusedMasterWeightOptimizer`.

Per step, the host reads the overflow flag once, in ``step()``, and only when it is checked
(at O1, O2 and O3, with any loss scale; with a dynamic one it reads the new scale in the same
sync): everything else (unscaling, the overflow check, the scale update, the copy of the master
weights into the model) is launched without waiting for the device.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._fused_master import supports_fused_master_weights
from ._master_step import read_overflow
from ._master_weights import MasterWeights
from ._optimizer_patch import AmpCalls, unwrap_optimizer, wrap_optimizer
from ._scaler import LossScaler
from ._step_paths import FusedPath, OrdinaryPath, StepOutcome, StepPath
from ._step_stages import Block, Stage, StepStages

if TYPE_CHECKING:
    from ._model import ModelAmpState
    from ._state import AmpSession

__all__ = ["OptimizerAmpState", "Stage", "optimizer_state"]

logger = logging.getLogger("amp_core.scaler")


class OptimizerAmpState(StepStages, AmpCalls):
    """Amp's record on one optimizer (``optimizer._amp_state``).

    Args:
        optimizer: The optimizer.
        session: The ``amp.initialize`` call it came from (loss scalers, properties).
        master_weights: Whether half params get fp32 master copies.
        fp32_masters: Full-precision values for params the model cast just now, used as the
            masters' initial values instead of the rounded half values.
        model_states: The models of the same call, told about masters made later (for a
            param group added after ``amp.initialize``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        session: AmpSession,
        master_weights: bool,
        fp32_masters: dict[nn.Parameter, torch.Tensor],
        model_states: list[ModelAmpState] | None = None,
    ) -> None:
        weights = MasterWeights()
        fused = master_weights and supports_fused_master_weights(optimizer)
        path: StepPath = (
            FusedPath(optimizer, weights)
            if fused
            else OrdinaryPath(optimizer, weights, master_weights)
        )
        super().__init__(optimizer, weights, path)
        self.session = session
        self.master_weights = master_weights
        self.model_states = model_states if model_states is not None else []
        self.fused = fused
        self._host_skips = 0
        # Steps the fused path skipped on the device without reading the flag back (static
        # loss scale): summed there, read only when skipped_steps is asked for.
        self._device_skips: torch.Tensor | None = None

        self.path.adopt_groups(list(optimizer.param_groups), fp32_masters)
        self._originals = wrap_optimizer(optimizer)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for gradient overflow (reads the device-side count, if any, back)."""
        on_device = int(self._device_skips.item()) if self._device_skips is not None else 0
        return self._host_skips + on_device

    # -- step, zero_grad, add_param_group --------------------------------------------------

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.require_not_interrupted("optimizer.step()")
        if self.stage is Stage.BACKWARD:
            raise RuntimeError(
                "optimizer.step() was called inside `with amp.scale_loss(...)`: until the block "
                "exits, the gradients are not unscaled (nor checked for overflow), so the step "
                "would move the weights loss_scale times too far. Call optimizer.step() after "
                "the with block (unindent it)."
            )
        if self.stage is Stage.ACCUMULATING:
            raise RuntimeError(
                "optimizer.step() was called while the gradients are still scaled: the last "
                "amp.scale_loss before step() used delay_unscale=True. Call the last "
                "amp.scale_loss of the step with delay_unscale=False (or call "
                "optimizer.zero_grad() to drop the scaled gradients)."
            )
        self.settle_stale_grads()  # a second step() after a fused one
        never_unscaled = not self.fused and self.stage is not Stage.UNSCALED
        if never_unscaled and any(p.grad is not None for p in self.model_params):
            warnings.warn(
                "The model has gradients that were never copied to its fp32 master weights; "
                "run backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`.",
                RuntimeWarning,
                stacklevel=3,
            )
        checks, self._checks = self._checks, []
        outcome = self.path.step(
            self._originals.step, closure, self._deferred, checks, self._read_overflow
        )
        self.session.flush_scale_updates()
        self._finish_step(outcome)
        return outcome.result

    def _finish_step(self, outcome: StepOutcome) -> None:
        if outcome.skipped:
            self._host_skips += 1
            self._log_skip(outcome.checks)
        if outcome.device_skip is not None:
            previous = self._device_skips
            self._device_skips = (
                outcome.device_skip if previous is None else previous + outcome.device_skip
            )
        # Taken or skipped, the masters' grads are dropped (as Apex's O2 did): model.zero_grad()
        # cannot reach them, so a loop that clears only the model's gradients (the transformers
        # Trainer does) would otherwise add every step's gradients to the last ones.
        self.weights.clear_grads()
        if outcome.stale_inv_scale is not None:
            self._enter(Stage.STEPPED, stale_inv_scale=outcome.stale_inv_scale)
        else:
            self._enter(Stage.READY)

    def _read_overflow(self, found_inf: torch.Tensor, loss_ids: list[int]) -> bool:
        """The one host sync of a step: the overflow flag, and with it the current values of the
        dynamic scales that set it (the scalers' host hints of whether the scale is below one).
        """
        scalers: list[LossScaler] = []
        for loss_id in loss_ids:
            scaler = self.session.scalers[loss_id]
            if scaler.dynamic and scaler.device is not None and scaler not in scalers:
                scalers.append(scaler)
        overflow, _ = read_overflow(found_inf, scalers)
        return overflow

    def _log_skip(self, checks: list[tuple[int, torch.Tensor]]) -> None:
        if self.session.verbosity <= 0:
            return
        for loss_id, flag in checks:
            if flag.item():
                scaler = self.session.scalers[loss_id]
                logger.warning(
                    "Gradient overflow.  Skipping step, loss scaler %d %s loss scale to %s",
                    loss_id,
                    "reducing" if scaler.dynamic else "keeping its static",
                    scaler.loss_scale(),
                )

    def _zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage is Stage.BACKWARD:
            self._drop_held_grads()
        elif self.stage is Stage.INTERRUPTED:
            for master in self.masters:
                master.grad = None
            self._checks = []
            self._enter(Stage.READY)
        elif self.fused:
            # A deferred backward still owes its scale update; its grads are then dropped,
            # with the overflow flags noted for them.
            self.materialize()
            for master in self.masters:
                master.grad = None
            self._checks = []
            self._enter(Stage.READY)
        elif self.stage is Stage.ACCUMULATING:
            self._enter(Stage.READY)
        self._originals.zero_grad(set_to_none=set_to_none)
        # Model grads in flight (accumulated with delay_unscale) belong to the same step.
        self.weights.drop_model_grads()
        self.session.flush_scale_updates()

    def _drop_held_grads(self) -> None:
        """``zero_grad`` inside a ``scale_loss`` block: every gradient is dropped, the earlier
        ones too (an exception in the block then leaves none)."""
        block = self._block
        assert block is not None
        prior = block.prior
        for master in self.masters:
            master.grad = None
        if self.fused:
            self._checks = []
            prior = Stage.READY
        elif prior is Stage.ACCUMULATING:
            prior = Stage.READY
        self._enter(Stage.BACKWARD, block=Block(prior, None, False, None))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``optimizer.add_param_group`` after ``amp.initialize``: the new group is treated as
        ``initialize`` treated the others (fp32 masters for its half params under O2, whose
        fused optimizers make their state; unscaled and checked at every level)."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, (torch.Tensor, set)):
            params = param_group["params"] = list(params)  # a generator is read once (as torch)
        given = [params] if isinstance(params, torch.Tensor) else list(params or [])
        known = {id(p) for p in self.model_params}
        if any(id(p) in known for p in given):
            raise ValueError(
                "some parameters appear in more than one parameter group (amp keeps fp32 "
                "master weights of them in an earlier group); add each parameter once."
            )
        assert self._originals.add_param_group is not None  # only wrapped when there is one
        self._originals.add_param_group(param_group)
        # The models find the new masters here (ModelAmpState.masters looks them up).
        self.path.adopt_groups([self.optimizer.param_groups[-1]], {})

    def check_closable(self) -> None:
        """Refuse ``amp.close()`` inside a ``scale_loss`` block of this optimizer."""
        if self.stage is Stage.BACKWARD:
            raise RuntimeError(
                "amp.close() was called inside `with amp.scale_loss(...)`: the block's "
                "gradients are still multiplied by the loss scale (unscaled only when the "
                "block exits), and a plain step() after close() would apply them that many "
                "times too large. Call amp.close() after the with block."
            )

    def settle_for_close(self) -> None:
        """Before ``amp.close()``: leave the gradients unscaled in place, as a plain step()
        reads them (a ``delay_unscale`` accumulation is finished, pending fused-step
        gradients unscaled; the partial gradients of an interrupted block are dropped)."""
        if self.stage is Stage.CLOSED:
            return
        if self.stage is Stage.INTERRUPTED:
            logger.warning(
                "amp.close() drops the gradients of %s: an exception interrupted the backward "
                "that was adding to them inside amp.scale_loss.",
                type(self.optimizer).__name__,
            )
            for p in self._all_params():
                p.grad = None
            self._enter(Stage.READY)
        self.materialize()
        self.settle_stale_grads()
        if self._accumulation is not None:
            self._finish_accumulation(self._accumulation)
        self.session.flush_scale_updates()

    def remove(self) -> None:
        """Restore ``step``, ``zero_grad`` and ``add_param_group`` (master weights stay in the
        param groups, or, on the fused path, the optimizer goes back to stepping its params
        without amp's masters). The optimizer is then CLOSED to amp."""
        unwrap_optimizer(self.optimizer, self._originals)
        self._checks = []
        self._enter(Stage.CLOSED)
        self.path.remove()


def optimizer_state(optimizer: Any) -> OptimizerAmpState | None:
    state = getattr(optimizer, "_amp_state", None)
    return state if isinstance(state, OptimizerAmpState) else None
