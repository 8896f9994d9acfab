"""What ``amp.initialize`` does to an optimizer: master weights, unscaling, skipped steps.

All of it is recorded on the optimizer's :class:`OptimizerAmpState` (``optimizer._amp_state``).
``optimizer.step``, ``optimizer.zero_grad`` and ``optimizer.add_param_group`` are wrapped on
the instance (Apex's contract needs a step that can be skipped, which no PyTorch hook offers, and
a group added later needs the same treatment as the first ones); :meth:`remove` restores them.

Each optimizer is at one :class:`Stage` of its step, changed only by :meth:`_enter`:

=============  =====================================================  ==========================
stage          meaning                                                left by
=============  =====================================================  ==========================
READY          no gradient of a scaled backward is in flight          a backward
BACKWARD       inside ``amp.scale_loss``: the backward adds to the    the block's exit; an
               grads in place, which carry the block's scale          exception in the block
ACCUMULATING   ``scale_loss(delay_unscale=True)`` left grads scaled   a backward; zero_grad
DEFERRED       (fused path) grads wait scaled for the fused step      a backward; step; zero_grad;
                                                                      ``amp.master_params``
UNSCALED       grads unscaled into place, overflow flags noted        a backward; step;
                                                                      zero_grad (fused)
STEPPED        (fused path) the step read grads that stay scaled      a backward; step; zero_grad;
                                                                      ``amp.master_params``
INTERRUPTED    an exception stopped a backward that added to grads    zero_grad
               in place (step and scale_loss refuse)
CLOSED         :meth:`remove` undid amp's wrapping                    (final)
=============  =====================================================  ==========================

The gradients stay where autograd (and a data-parallel wrapper) put them. A backward
(``amp.scale_loss`` entry) first brings STEPPED grads and DEFERRED ones of another scale into
place (READY, UNSCALED), and unscales ACCUMULATING grads of another loss scaler by their own
scale (UNSCALED); then the grads in place are multiplied by the block's scale (the masters'
move into the model's half grads) unless they carry it already (ACCUMULATING, DEFERRED of the
same scale), and it enters BACKWARD. Its exit goes to ACCUMULATING (``delay_unscale``),
DEFERRED (fused path) or UNSCALED, unscaling the sum; with a static scale of one and no master
weights, a ``delay_unscale`` exit goes back to the stage before the block. An exception in the
block drops the grads when there were none at its entry, puts back the copies
``restore_on_error=True`` took, or else leaves INTERRUPTED. ``zero_grad`` in the block drops
every grad. Scale updates wait for the step (:meth:`LossScaler.note_update_`).

``step()`` at ACCUMULATING or BACKWARD, ``amp.scale_loss`` at BACKWARD (nested blocks for one
optimizer) and at CLOSED are refused with the fix.

How masters are kept and the step is taken is a :class:`~amp_core._step_paths.StepPath`: the
ordinary one, or the fused master-weight one for an optimizer that implements
:class:`~amp_core._fused_master.FusedMasterWeightOptimizer`.

Per step, the host reads the overflow flag once, in ``step()``, and only when it is checked
(at O1, O2 and O3, with any loss scale; with a dynamic one it reads the new scale in the same
sync): everything else (unscaling, the overflow check, the scale update, the copy of the master
weights into the model) is launched without waiting for the device.
"""

from __future__ import annotations

import enum
import logging
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ._fused_master import supports_fused_master_weights
from ._master_weights import MasterWeights, read_overflow
from ._scaler import LossScaler, coalesce_half_sparse_grads, scale_grads_
from ._state import class_method, restore_method
from ._step_paths import Deferred, FusedPath, OrdinaryPath, StepOutcome, StepPath

if TYPE_CHECKING:
    from ._model import ModelAmpState
    from ._state import AmpSession

__all__ = ["OptimizerAmpState", "Stage", "optimizer_state"]

logger = logging.getLogger("amp_core.scaler")


class Stage(enum.Enum):
    """Where one optimizer is in its step (see the module docstring)."""

    READY = "ready"
    BACKWARD = "backward"
    ACCUMULATING = "accumulating"
    DEFERRED = "deferred"
    UNSCALED = "unscaled"
    STEPPED = "stepped"
    INTERRUPTED = "interrupted"
    CLOSED = "closed"


@dataclass(frozen=True)
class Accumulation:
    """At ACCUMULATING: the scaler whose scale the gradients carry, and how to finish."""

    scaler: LossScaler
    loss_id: int
    check: bool  # check the gradients for inf/nan when they are unscaled
    update: bool  # update the scale then (not with delay_overflow_check)
    version: int  # the scaler's update count when the gradients took its scale

    def carries(self, scaler: LossScaler) -> bool:
        """Whether the gradients carry the current scale of ``scaler`` (known on the host)."""
        return scaler is self.scaler and scaler.version == self.version


@dataclass(frozen=True)
class Block:
    """At BACKWARD: the stage before the ``amp.scale_loss`` block and what an exception in
    the block can restore."""

    prior: Stage
    accumulation: Accumulation | None
    held: bool  # gradients were in place at the entry (the backward adds to them)
    # Their copies (``restore_on_error=True``), in the order of ``_all_params``; else None.
    saved: list[torch.Tensor | None] | None
    # The fused step's pending gradients the block adds to (DEFERRED before it), or None.
    deferred: Deferred | None = None


def _add_grad(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``old + new`` for two gradients of one param, in place in ``old`` as autograd
    accumulates (the tensor a param held stays its gradient), or in ``new`` when only ``new``
    is dense."""
    if old.is_sparse and not new.is_sparse:
        return new.add_(old)
    return old.add_(new)


class OptimizerAmpState:
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
        self.optimizer = optimizer
        self.session = session
        self.master_weights = master_weights
        self.model_states = model_states if model_states is not None else []
        self.weights = MasterWeights()
        self.fused = master_weights and supports_fused_master_weights(optimizer)
        self.path: StepPath = (
            FusedPath(optimizer, self.weights)
            if self.fused
            else OrdinaryPath(optimizer, self.weights, master_weights)
        )
        self.stage = Stage.READY
        self._deferred: Deferred | None = None  # at DEFERRED: the waiting backward
        self._stale_inv_scale: torch.Tensor | None = None  # at STEPPED: the grads' scale
        self._accumulation: Accumulation | None = None  # at ACCUMULATING: the grads' scale
        self._block: Block | None = None  # at BACKWARD: the stage before, the held grads
        self._checks: list[tuple[int, torch.Tensor]] = []  # overflow flags step() honours
        self._host_skips = 0
        # Steps the fused path skipped on the device without reading the flag back (static
        # loss scale): summed there, read only when skipped_steps is asked for.
        self._device_skips: torch.Tensor | None = None

        self.path.adopt_groups(list(optimizer.param_groups), fp32_masters)
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        # Wrappers such as LARC may lack add_param_group: then there is nothing to wrap.
        self._original_add_param_group = getattr(optimizer, "add_param_group", None)
        # Bound to the optimizer itself: LR schedulers re-bind `optimizer.step.__func__` to it.
        optimizer.step = types.MethodType(_amp_step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(  # type: ignore[method-assign]
            _amp_zero_grad, optimizer
        )
        if self._original_add_param_group is not None:
            optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
                _amp_add_param_group, optimizer
            )

    # -- the one place the stage changes -----------------------------------------------------

    def _enter(
        self,
        stage: Stage,
        *,
        deferred: Deferred | None = None,
        stale_inv_scale: torch.Tensor | None = None,
        accumulation: Accumulation | None = None,
        block: Block | None = None,
    ) -> None:
        assert (stage is Stage.DEFERRED) == (deferred is not None)
        assert (stage is Stage.STEPPED) == (stale_inv_scale is not None)
        assert (stage is Stage.ACCUMULATING) == (accumulation is not None)
        assert (stage is Stage.BACKWARD) == (block is not None)
        self.stage = stage
        self._deferred = deferred
        self._stale_inv_scale = stale_inv_scale
        self._accumulation = accumulation
        self._block = block

    def require_open(self, call: str) -> None:
        """Refuse ``call`` on an optimizer whose amp wrapping was removed."""
        if self.stage is Stage.CLOSED:
            raise RuntimeError(
                f"{call} got a {type(self.optimizer).__name__} whose amp wrapping was removed "
                "(amp.initialize was called again for it, or its session was closed). Pass the "
                "optimizer returned by the latest amp.initialize."
            )

    def require_not_interrupted(self, call: str) -> None:
        """Refuse ``call`` while the gradients hold part of a backward an exception stopped."""
        if self.stage is Stage.INTERRUPTED:
            raise RuntimeError(
                f"{call} got a {type(self.optimizer).__name__} whose gradients hold part of a "
                "backward that an exception interrupted inside `with amp.scale_loss(...)`, "
                "added to the gradients accumulated before it (and scaled): they are not a "
                "gradient of anything. Call optimizer.zero_grad() to drop them, or pass "
                "restore_on_error=True to amp.scale_loss to have such an exception restore the "
                "accumulated gradients (at the cost of a copy of them per block)."
            )

    # -- what others read ----------------------------------------------------------------------

    @property
    def model_params(self) -> list[nn.Parameter]:
        """The half params stepped through a master, in order."""
        return cast(list[nn.Parameter], self.weights.model_params)

    @property
    def masters(self) -> list[torch.Tensor]:
        """Their fp32 masters, in the same order."""
        return self.weights.masters

    @property
    def direct_params(self) -> list[torch.Tensor]:
        """The params the optimizer steps itself."""
        return self.weights.direct_params

    @property
    def grads_scaled(self) -> bool:
        """Whether the grads hold scaled values (a ``delay_unscale`` backward)."""
        return self.stage is Stage.ACCUMULATING

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for gradient overflow (reads the device-side count, if any, back)."""
        on_device = int(self._device_skips.item()) if self._device_skips is not None else 0
        return self._host_skips + on_device

    # -- backward (amp.scale_loss) -------------------------------------------------------------

    def check_block_entry(self) -> None:
        """Refuse an ``amp.scale_loss`` block inside another one for this optimizer."""
        self.require_open("amp.scale_loss")
        self.require_not_interrupted("amp.scale_loss")
        if self.stage is Stage.BACKWARD:
            raise RuntimeError(
                f"amp.scale_loss was entered for a {type(self.optimizer).__name__} that is "
                "already inside another `with amp.scale_loss(...)` block: nested blocks for "
                "one optimizer are not supported (nor were they in Apex). Leave the first "
                "block after its backward before entering the next one, one block per loss: "
                "`with amp.scale_loss(loss0, optimizer, loss_id=0) as scaled: "
                "scaled.backward()`, then the same for loss1."
            )

    def begin_backward(
        self, scaler: LossScaler, *, delay_unscale: bool, unit: bool, restore: bool = False
    ) -> None:
        """At ``scale_loss`` entry: bring the gradients in place to the block's scale (BACKWARD).

        The gradients stay where a data-parallel wrapper reduces them: the backward adds to
        them, so a wrapper that all-reduces ``.grad`` during this backward reduces the whole
        accumulated gradient. Gradients already in place are multiplied by this block's scale
        (unless a ``delay_unscale`` backward of the same scale left them so), and unscaled fp32
        master gradients move back into the model's half gradients, scaled, so that the exit
        unscales the sum once. Gradients a ``delay_unscale`` backward left scaled by another
        loss scaler are unscaled by their own scale first, and pending fused-step gradients are
        unscaled into place (both as ``master_params`` would).

        Args:
            scaler: The block's loss scaler.
            delay_unscale: Unused here (the exit decides); kept for symmetry with the exit.
            unit: Nothing is scaled (a static scale of one, no masters).
            restore: Copy the gradients in place, so that an exception in the block restores
                them exactly (otherwise, see :meth:`abort_backward`).
        """
        del delay_unscale
        self.check_block_entry()
        deferred = self._deferred
        if deferred is not None and (deferred.scaler, deferred.version) == (scaler, scaler.version):
            # The pending gradients carry this block's scale: the backward adds to them, and
            # the fused step checks and unscales the sum (its scale update is owed to the step
            # in any case, see LossScaler.note_update_).
            carried = Accumulation(scaler, deferred.loss_id, deferred.check, True, deferred.version)
            self._enter(Stage.ACCUMULATING, accumulation=carried)
        else:
            deferred = None
            self.materialize()  # DEFERRED -> UNSCALED
        self.settle_stale_grads()  # STEPPED -> READY
        accumulation = self._accumulation
        if accumulation is not None and not accumulation.carries(scaler):
            self._finish_accumulation(accumulation)  # ACCUMULATING -> UNSCALED
            accumulation = None
        held = self._has_grads()
        saved = self._copy_grads() if restore and held else None
        if held and not unit:
            self._scale_grads_in_place(scaler, scaled=accumulation is not None)
        block = Block(self.stage, accumulation, held, saved, deferred)
        self._enter(Stage.BACKWARD, block=block)

    def _all_params(self) -> list[torch.Tensor]:
        return [*self.direct_params, *self.model_params, *self.masters]

    def _has_grads(self) -> bool:
        return any(p.grad is not None for p in self._all_params())

    def _copy_grads(self) -> list[torch.Tensor | None]:
        with torch.no_grad():
            return [None if p.grad is None else p.grad.clone() for p in self._all_params()]

    def _scale_grads_in_place(self, scaler: LossScaler, *, scaled: bool) -> None:
        """Multiply the gradients in place by the scale of ``scaler`` (the direct params'
        unless ``scaled`` says they carry it already) and move the masters' unscaled gradients
        into the model's half gradients, scaled (exact for a power-of-two scale)."""
        # amp's own arithmetic, outside the O1 policy.
        with torch.no_grad(), torch._C._DisableAutocast():
            if not scaled:
                direct = [p.grad for p in self.direct_params if p.grad is not None]
                scale_grads_(direct, scaler)
            for param, master in self.weights.pairs():
                grad = master.grad
                if grad is None:
                    continue
                master.grad = None
                scale = scaler.scale_tensor(scaler.device or grad.device).to(grad.device)
                moved = (grad * scale).to(device=param.device, dtype=param.dtype)
                param.grad = moved if param.grad is None else param.grad.add_(moved)

    def abort_backward(self) -> None:
        """After an exception in the ``scale_loss`` block.

        Where no gradient was in place at the entry, the failed backward's are dropped and the
        stage goes back to what it was: nothing is lost. Where the block was entered with
        ``restore_on_error=True``, the gradients copied at the entry are put back. Otherwise
        the gradients hold the earlier ones plus part of the failed backward, scaled: the
        optimizer is then INTERRUPTED, and ``step()`` and ``scale_loss`` refuse until
        ``zero_grad()`` drops them.
        """
        block = self._block
        if self.stage is not Stage.BACKWARD or block is None:
            return  # closed meanwhile
        params = self._all_params()
        if not block.held:
            for p in params:
                p.grad = None
            self._enter(block.prior if block.accumulation is None else Stage.READY)
        elif block.saved is not None:
            for p, grad in zip(params, block.saved, strict=True):
                p.grad = grad
            if block.deferred is not None:
                self._enter(Stage.DEFERRED, deferred=block.deferred)
            else:
                self._enter(block.prior, accumulation=block.accumulation)
        else:
            self._enter(Stage.INTERRUPTED)

    def _take_block(self) -> Block | None:
        """At the exit of the block: its record (None when the optimizer was closed in it)."""
        block = self._block
        if self.stage is not Stage.BACKWARD or block is None:
            return None
        return block

    def end_backward(
        self,
        scaler: LossScaler,
        found_inf: torch.Tensor,
        *,
        loss_id: int,
        check: bool,
        update: bool,
        delay_unscale: bool,
        defer_loss_id: int | None,
    ) -> bool:
        """At ``scale_loss`` exit: unscale the new grads into place and add the held ones.

        Master weights receive the model's half grads as fp32 (the model's grads are freed).
        With ``delay_unscale`` the grads stay scaled (ACCUMULATING). On the fused path, when
        ``defer_loss_id`` is given and no unscaled gradient is in place, the gradients are left
        scaled for the fused step instead (DEFERRED), and True is returned: the caller must then
        leave the scale update (and the overflow note) to ``step()``.
        """
        if self._take_block() is None:
            return False
        if delay_unscale:
            self._enter(
                Stage.ACCUMULATING,
                accumulation=Accumulation(scaler, loss_id, check, update, scaler.version),
            )
            return False
        if defer_loss_id is not None and self.path.may_defer():
            deferred = Deferred(scaler, defer_loss_id, check, scaler.version)
            self._enter(Stage.DEFERRED, deferred=deferred)
            return True
        self._unscale_into_place(scaler, found_inf, check)
        return False

    def end_unit_backward(
        self, scaler: LossScaler, found_inf: torch.Tensor, *, check: bool, delay_unscale: bool
    ) -> None:
        """At ``scale_loss`` exit with nothing scaled (a static scale of one, no masters): add
        the held grads back; unless ``delay_unscale``, with ``check``, raise ``found_inf`` when a
        gradient the optimizer reads holds an inf or a nan (UNSCALED)."""
        block = self._take_block()
        if block is None:
            return
        if delay_unscale:
            self._enter(block.prior)
            return
        if check:
            coalesce_half_sparse_grads(self.direct_params)
            grads = [p.grad for p in self.direct_params if p.grad is not None]
            scaler.unscale_(grads, found_inf, check=True)
        self._enter(Stage.UNSCALED)

    def _finish_accumulation(self, accumulation: Accumulation) -> None:
        """ACCUMULATING -> UNSCALED: unscale the held grads by the scale they carry, as a
        ``scale_loss`` of their loss without ``delay_unscale`` would have."""
        found_inf = torch.zeros((), dtype=torch.float32, device=accumulation.scaler.device)
        self._unscale_into_place(accumulation.scaler, found_inf, accumulation.check)
        if accumulation.update:
            accumulation.scaler.note_update_(found_inf)
        if accumulation.check:
            self.note_overflow_check(accumulation.loss_id, found_inf)

    def new_overflow(self, found_inf: torch.Tensor) -> torch.Tensor:
        """``found_inf`` of this optimizer's gradients at a block's exit, cleared where an
        earlier block of the step already found an overflow in them (the inf is still there:
        it is that block's, not this one's)."""
        if not self._checks:
            return found_inf
        # amp's own arithmetic, outside the O1 policy.
        with torch._C._DisableAutocast():
            earlier = torch.stack([f.to(found_inf.device) for _, f in self._checks]).sum()
            return found_inf * (earlier == 0)

    def note_overflow_check(self, loss_id: int, found_inf: torch.Tensor) -> None:
        """Remember an overflow flag that the next ``step()`` must honour."""
        self._checks.append((loss_id, found_inf))

    def _unscale_into_place(self, scaler: LossScaler, found_inf: torch.Tensor, check: bool) -> None:
        self.weights.unscale_direct_grads(scaler, found_inf, check=check)
        self.weights.unscale_into_masters(scaler, found_inf, check=check)
        self._enter(Stage.UNSCALED)

    def materialize(self) -> None:
        """DEFERRED -> UNSCALED: unscale the waiting backward's grads into place, as
        ``scale_loss`` exit would have (half grads to the masters' ``.grad`` as fp32), update
        the loss scale and note the overflow for the next ``step()``. Else a no-op."""
        deferred = self._deferred
        if self.stage is not Stage.DEFERRED or deferred is None:
            return
        found_inf = torch.zeros((), dtype=torch.float32, device=deferred.scaler.device)
        self._unscale_into_place(deferred.scaler, found_inf, deferred.check)
        deferred.scaler.note_update_(found_inf)
        if deferred.check:
            self.note_overflow_check(deferred.loss_id, found_inf)

    def settle_stale_grads(self) -> None:
        """STEPPED -> READY: unscale into place the grads a fused step read scaled and nobody
        zeroed, so that they accumulate as on the ordinary path and ``master_params`` or a
        second ``step()`` see them as the ordinary path leaves them. Else a no-op."""
        if self.stage is not Stage.STEPPED or self._stale_inv_scale is None:
            return
        assert isinstance(self.path, FusedPath)
        self.path.settle_stale_grads(self._stale_inv_scale)
        self._enter(Stage.READY)

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
            self._original_step, closure, self._deferred, checks, self._read_overflow
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
        self._original_zero_grad(set_to_none=set_to_none)
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
        assert self._original_add_param_group is not None  # only wrapped when there is one
        self._original_add_param_group(param_group)
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
        originals = (self._original_step, self._original_zero_grad, self._original_add_param_group)
        for (name, wrapper), original in zip(_WRAPPERS.items(), originals, strict=True):
            restore_method(self.optimizer, name, wrapper, original)
        self._checks = []
        self._enter(Stage.CLOSED)
        self.path.remove()


def _amp_step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    # What the wrapper of a torch LR scheduler records (a skipped step is a step to it).
    optimizer._opt_called = True
    state = optimizer_state(optimizer)
    return state._step(closure) if state else class_method(optimizer, "step")(closure)


# torch's LR schedulers wrap `optimizer.step` to see whether it ran before their own step(),
# and warn when `optimizer.step` lacks their mark (it was replaced after the scheduler was
# built: amp.initialize after the scheduler, the usual order of Apex scripts). amp's step
# records the call itself (`_opt_called` above), so it carries the mark: a scheduler built
# before or after amp.initialize then warns only when it would without amp.
_amp_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _amp_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    state = optimizer_state(optimizer)
    state._zero_grad(set_to_none) if state else class_method(optimizer, "zero_grad")(set_to_none)


def _amp_add_param_group(optimizer: Any, param_group: dict[str, Any]) -> None:
    state = optimizer_state(optimizer)
    (state.add_param_group if state else class_method(optimizer, "add_param_group"))(param_group)


_WRAPPERS = dict(step=_amp_step, zero_grad=_amp_zero_grad, add_param_group=_amp_add_param_group)


def optimizer_state(optimizer: Any) -> OptimizerAmpState | None:
    state = getattr(optimizer, "_amp_state", None)
    return state if isinstance(state, OptimizerAmpState) else None
