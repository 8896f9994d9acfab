"""Where one optimizer is in its step under amp, and the moves of an ``amp.scale_loss`` block.

:class:`StepStages` is the part of an optimizer's amp record
(:class:`~amp_core._optimizer.OptimizerAmpState`) that tracks the gradients between backward and
step. Each optimizer is at one :class:`Stage` of its step, changed only by :meth:`_enter`:

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
CLOSED         ``OptimizerAmpState.remove`` undid amp's wrapping      (final)
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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ._master_weights import MasterWeights
from ._overflow_checks import coalesce_half_sparse_grads, scale_grads_
from ._scaler import LossScaler
from ._step_paths import Deferred, FusedPath, StepPath

__all__ = ["Accumulation", "Block", "Stage", "StepStages"]


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


class StepStages:
    """The stage of one optimizer's step and the gradients' moves between backward and step.

    Args:
        optimizer: The optimizer (named in the errors).
        weights: Its masters and directly stepped params.
        path: How its step is taken (ordinary or fused).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, weights: MasterWeights, path: StepPath
    ) -> None:
        self.optimizer = optimizer
        self.weights = weights
        self.path = path
        self.stage = Stage.READY
        self._deferred: Deferred | None = None  # at DEFERRED: the waiting backward
        self._stale_inv_scale: torch.Tensor | None = None  # at STEPPED: the grads' scale
        self._accumulation: Accumulation | None = None  # at ACCUMULATING: the grads' scale
        self._block: Block | None = None  # at BACKWARD: the stage before, the held grads
        self._checks: list[tuple[int, torch.Tensor]] = []  # overflow flags step() honours

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
