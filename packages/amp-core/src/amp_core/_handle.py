"""``amp.scale_loss`` and the other per-step entry points."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._opt_levels import OptLevel
from ._optimizer import OptimizerAmpState, optimizer_state
from ._scaler import LossScaler
from ._state import AmpSession, registry

__all__ = ["load_state_dict", "master_params", "scale_loss", "skipped_steps", "state_dict"]

_SCALER_KEY = re.compile(r"(session[1-9][0-9]*\.)?loss_scaler(0|[1-9][0-9]*)")

_NOT_INITIALIZED = (
    "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized. "
    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
    "before `with amp.scale_loss`."
)


def _optimizer_states(optimizers: Any) -> list[OptimizerAmpState]:
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    states: list[OptimizerAmpState] = []
    for optimizer in items:
        state = optimizer_state(optimizer)
        if state is None:
            raise RuntimeError(
                f"amp.scale_loss got a {type(optimizer).__name__} that amp.initialize did not "
                "return. Pass the optimizer(s) returned by amp.initialize."
            )
        state.require_open("amp.scale_loss")
        if state not in states:  # the same optimizer twice: once
            states.append(state)
    return states


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
    *,
    restore_on_error: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss * loss_scale`` for ``backward()``; unscale the gradients on exit.

    On exit the gradients of the params the optimizer(s) step hold unscaled values (for O2,
    the fp32 master grads, which :func:`master_params` yields). At O1, O2 and O3, with any loss
    scale, a gradient holding an inf or a nan (before or after unscaling) makes the next
    ``optimizer.step()`` a no-op; a dynamic scale is lowered too (not below its floor).

    The gradients stay where PyTorch puts them: the backward adds to the gradients that
    earlier backwards of the step accumulated (multiplied by the loss scale at the block's
    entry; under O2 the masters' gradients move back into the model's half gradients, scaled),
    so a data-parallel wrapper that all-reduces ``.grad`` during this backward
    (``DistributedDataParallel`` after ``no_sync()``, FSDP2) reduces the whole accumulated
    gradient, and every rank ends with the same one. ``docs/distributed.rst`` shows
    gradient accumulation with each wrapper. A dynamic scale is updated once per step, at
    ``optimizer.step()`` (or ``zero_grad()``, or when it is read), with the overflow of every
    block since the last update, so that ranks agree on it.

    * **An exception in the block** (raised by the backward, e.g. out of memory, or by the
      code in the block) propagates. Where no gradient was in place when the block started
      (the first backward after ``zero_grad()``), those the failed backward made are dropped
      and the step is where it was. With ``restore_on_error=True``, the gradients accumulated
      before the block are copied at its entry and put back. Otherwise they hold part of the
      failed backward: ``optimizer.step()`` and the next ``amp.scale_loss`` then raise
      ``RuntimeError`` until ``optimizer.zero_grad()`` drops them. (Entering the block first
      unscales into place the gradients a fused O2 step left pending, as
      :func:`master_params` does, and those a ``delay_unscale`` backward of another
      ``loss_id`` left scaled: that stays.)
    * **optimizer.step()** of an optimizer passed here is refused inside the block
      (``RuntimeError``: the gradients are not unscaled yet); call it after the block.
      Stepping another optimizer inside the block is fine.
    * **Nested blocks** for the same optimizer are refused (``RuntimeError``), as Apex did not
      support them; blocks for different optimizers may nest.
    * ``optimizer.zero_grad()`` inside the block drops the held gradients too.
    * Gradients left scaled by a ``delay_unscale`` backward of another ``loss_id`` are
      unscaled by their own loss scale (and its scale updated) when this block starts.

    Args:
        loss: The loss tensor.
        optimizers: The optimizer, or list of optimizers, returned by ``amp.initialize``
            that will step the gradients of this backward.
        loss_id: Which loss scaler to use, ``0 <= loss_id < num_losses``.
        model: Unused; kept for Apex compatibility.
        delay_unscale: Leave the gradients scaled (gradient accumulation, several
            backward passes): the last ``scale_loss`` before ``step()`` must not delay.
        delay_overflow_check: Unscale, but neither update the scale nor skip a step.
        restore_on_error: Copy the gradients already accumulated at the block's entry, so
            that an exception in the block restores them exactly (a loop that skips a bad
            micro-batch then keeps the others); costs one copy of them per block.

    Raises:
        RuntimeError: before ``amp.initialize``, for an optimizer it did not return, or for an
            optimizer already inside another ``scale_loss`` block.
        ValueError: for a ``loss_id`` out of range.

    Example:
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()  # after the block
    """
    session = registry.current
    if session is None:
        raise RuntimeError(_NOT_INITIALIZED)
    if not session.props.enabled:
        yield loss
        return
    states = _optimizer_states(optimizers)
    owner: AmpSession = states[0].session if states else session
    if any(s.session is not owner for s in states):
        raise RuntimeError(
            "amp.scale_loss got optimizers from different amp.initialize calls; pass the "
            "optimizers of one call."
        )
    if not 0 <= loss_id < len(owner.scalers):
        raise ValueError(
            f"loss_id={loss_id} is out of range: amp.initialize was called with "
            f"num_losses={len(owner.scalers)}."
        )
    scaler = owner.scalers[loss_id]
    casting = owner.casting
    # Gradients that are not finite skip the step under any loss scale, but at O0 (plain fp32,
    # as Apex's: a static scale there is never checked).
    check = (scaler.dynamic or owner.props.opt_level is not OptLevel.O0) and not (
        delay_overflow_check
    )
    # Nothing to scale or copy (O0, O3): Apex's fast path, with the overflow check alone.
    unit = not owner.props.master_weights and scaler.is_unit_static
    for state in states:  # every refusal before any state changes
        state.check_block_entry()
    # A copy: the backward keeps the factor, and a scale update during the block (a step of
    # the same loss's other optimizer) changes the scaler's tensor in place.
    scale = None if unit else scaler.scale_tensor(loss.device).clone()
    for state in states:
        state.begin_backward(
            scaler, delay_unscale=delay_unscale, unit=unit, restore=restore_on_error
        )
    scaled = loss.float() if scale is None else loss.float() * scale
    # The backward runs without O1's casts, as under Apex (whose casts were Python-level
    # patches of the forward functions) and as after a torch.autocast block: backward ops run
    # in the dtypes the forward saved. With autocast left on, the engine would run them through
    # the autocast kernels too, and the policy's fp32 ops (the bias gradients' sums) would cast.
    suspend = (
        casting.autocast_off()
        if casting is not None and casting.is_active()
        else contextlib.nullcontext()
    )
    try:
        with suspend:
            yield scaled
    except BaseException:
        # The gradients and the stage go back to what they were before the block.
        for state in states:
            state.abort_backward()
        if casting is not None:
            casting.clear_cache()
        raise
    try:
        _finish_backward(
            states, scaler, loss_id, loss.device, check, unit, delay_unscale, delay_overflow_check
        )
    finally:
        if casting is not None:
            casting.clear_cache()  # the weights are about to change


def _finish_backward(
    states: list[OptimizerAmpState],
    scaler: LossScaler,
    loss_id: int,
    device: torch.device,
    check: bool,
    unit: bool,
    delay_unscale: bool,
    delay_overflow_check: bool,
) -> None:
    """``scale_loss`` exit: unscale (or defer), update the scale, note the overflow flags.

    Each optimizer checks its own gradients; the block overflowed where the gradients of any of
    them overflowed, save those already known to hold an inf from an earlier block of the step
    (the backward adds to them): a block skips the steps of all its optimizers when its own
    backward overflowed, as in Apex, and an earlier block's overflow skips only the optimizers
    of that block.
    """
    flags = [torch.zeros((), dtype=torch.float32, device=device) for _ in states]
    if unit:
        for state, flag in zip(states, flags, strict=True):
            state.end_unit_backward(scaler, flag, check=check, delay_unscale=delay_unscale)
        if check and not delay_unscale:
            found_inf = _block_overflow(states, flags)
            for state in states:
                state.note_overflow_check(loss_id, found_inf)
        return
    # A fused master-weight optimizer alone may take the scaled grads as they are: its
    # step unscales, checks and updates the scale (see _fused_master).
    defer_loss_id = loss_id if len(states) == 1 and not delay_overflow_check else None
    deferred = False
    for state, flag in zip(states, flags, strict=True):
        deferred = (
            state.end_backward(
                scaler,
                flag,
                loss_id=loss_id,
                check=check,
                update=not delay_overflow_check,
                delay_unscale=delay_unscale,
                defer_loss_id=defer_loss_id,
            )
            or deferred
        )
    if not (delay_unscale or deferred):
        found_inf = _block_overflow(states, flags)
        if not delay_overflow_check:
            scaler.note_update_(found_inf)  # applied at the step (see note_update_)
        if check:
            for state in states:
                state.note_overflow_check(loss_id, found_inf)


def _block_overflow(states: list[OptimizerAmpState], flags: list[torch.Tensor]) -> torch.Tensor:
    """The block's overflow flag from each optimizer's (see :func:`_finish_backward`)."""
    found_inf = states[0].new_overflow(flags[0])
    for state, flag in zip(states[1:], flags[1:], strict=True):
        found_inf = found_inf + state.new_overflow(flag).to(found_inf.device)
    return found_inf


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Yield the params ``optimizer`` steps: fp32 masters under O2, the model's otherwise.

    With an optimizer on the fused master-weight path (``amp_optimizers.FusedAdam`` under O2),
    this first unscales the pending gradients into the masters' ``.grad`` (so that, e.g.,
    gradient clipping sees them), and the step then reads those instead of the half grads;
    after a step, it unscales the gradients that step read, as the ordinary path leaves them.

    Example:
        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    state = optimizer_state(optimizer)
    if state is not None:
        state.weights.take_model_edits()  # the masters follow in-place edits of the model
    if state is not None and state.fused:
        # The fused path keeps the masters in the optimizer: give their unscaled fp32 grads.
        state.materialize()
        state.settle_stale_grads()
        by_param = {id(p): m for p, m in zip(state.model_params, state.masters, strict=True)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield by_param.get(id(p), p)
        return
    for group in optimizer.param_groups:
        yield from group["params"]


def _prefixed_sessions() -> list[tuple[str, AmpSession]]:
    """The live sessions with their key prefix: none for the latest ``amp.initialize`` call
    (Apex's format), ``session<k>.`` for the ``k``-th call before it."""
    sessions = registry.live_sessions()
    last = len(sessions) - 1
    return [
        ("" if index == last else f"session{last - index}.", session)
        for index, session in enumerate(sessions)
    ]


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers of every live ``amp.initialize`` call, as Apex's ``amp.state_dict``.

    The latest call owns Apex's keys ``"loss_scaler<j>"`` (a single call, the usual case,
    gives Apex's format). When ``amp.initialize`` was called several times (once per model)
    and the optimizers of earlier calls are still in use, the scalers of the ``k``-th call
    before the latest follow under the keys ``"session<k>.loss_scaler<j>"``, so that no
    model's scale is lost.

    Returns:
        ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    Raises:
        RuntimeError: before ``amp.initialize``.

    .. note:: Reads the scales from the device: a host sync. With several calls registered it
        first runs Python's garbage collector, to drop the calls whose objects are gone.
    """
    if registry.current is None:
        if registry.closed:
            raise RuntimeError(
                "amp.state_dict() was called after amp.close(), which ended every "
                "amp.initialize call: there is no loss scaler to save. Save amp.state_dict() "
                "before amp.close(), or call amp.initialize again first."
            )
        raise RuntimeError("amp.state_dict() was called before amp.initialize().")
    out: dict[str, Any] = {} if destination is None else destination
    for prefix, session in _prefixed_sessions():
        for idx, scaler in enumerate(session.scalers):
            out[f"{prefix}loss_scaler{idx}"] = scaler.state_dict()
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore the loss scalers saved by :func:`state_dict`.

    As in Apex, the keys ``"loss_scaler<j>"`` load into the latest ``amp.initialize`` call,
    which must have as many losses as were saved; ``"session<k>.loss_scaler<j>"`` load into
    the ``k``-th live call before it. Earlier live calls that the checkpoint has no keys for
    keep their scalers: a checkpoint saved by one call loads into the latest call of a
    process that called ``amp.initialize`` before (for another model, or for the model
    being resumed) without deleting those objects.

    Every entry is validated before anything is loaded: an error leaves every scaler as it was.
    A scale outside ``[min_loss_scale, max_loss_scale]`` of the new call is brought within it
    (with a warning), as is an ``unskipped`` count not below the scale window.

    Raises:
        RuntimeError: before ``amp.initialize``, or for a key that is not a loss scaler (as
            Apex).
        TypeError: ``state`` is not a dict, or a field has the wrong type (a scale that is not
            a number, a count that is not an int).
        ValueError: a missing or extra loss scaler (a call saved with another ``num_losses``,
            or more calls saved than are live), a missing or unknown field, a loss scale of 0,
            negative, inf, nan or beyond float32, or a negative count.
    """
    if registry.current is None:
        raise RuntimeError("amp.load_state_dict() was called before amp.initialize().")
    if not isinstance(state, Mapping):
        raise TypeError(
            f"amp.load_state_dict expects the dict returned by amp.state_dict(), got "
            f"{type(state).__name__}."
        )
    unexpected = [
        key for key in state if not isinstance(key, str) or not _SCALER_KEY.fullmatch(key)
    ]
    if unexpected:  # RuntimeError, as Apex's
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected)
            + ". amp.load_state_dict takes the dict returned by amp.state_dict()."
        )
    sessions = _prefixed_sessions()
    saved_prefixes = {key.rsplit("loss_scaler", 1)[0] for key in state}
    expected: list[tuple[str, LossScaler]] = []
    wanted: set[str] = set()
    for prefix, session in sessions:
        keys = [f"{prefix}loss_scaler{idx}" for idx in range(len(session.scalers))]
        if prefix and prefix not in saved_prefixes:
            continue  # an earlier call the checkpoint does not cover keeps its scalers
        wanted.update(keys)
        if not session.props.enabled:  # a disabled call keeps nothing, ignores its entries
            wanted.update(k for k in state if k.startswith(prefix or "loss_scaler"))
            continue
        expected.extend(zip(keys, session.scalers, strict=True))
    missing = [key for key, _ in expected if key not in state]
    extra = [key for key in state if key not in wanted]
    if missing or extra:
        counts = [len(s.scalers) for _, s in sessions]
        raise ValueError(
            f"amp.load_state_dict: the checkpoint does not match the loss scalers of this run "
            f"(missing {sorted(missing)}, unexpected {sorted(extra)}). This run has "
            f"{len(sessions)} live amp.initialize call(s) with num_losses {counts} (in call "
            'order). The keys "loss_scaler<j>" load into the latest call, which must have the '
            'saved num_losses; "session<k>.loss_scaler<j>" into the k-th live call before it. '
            "Call amp.initialize with the num_losses of the run that saved the checkpoint."
        )
    checked = [
        (scaler, scaler.check_state_dict(state[key], f'state_dict["{key}"]'))
        for key, scaler in expected
    ]
    for scaler, (scale, unskipped) in checked:  # everything is valid: now load it all
        scaler.load_checked(scale, unskipped)


def skipped_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many ``optimizer.step()`` calls were skipped for gradient overflow.

    With a dynamic loss scale every overflow skips its step. With a static scale the ordinary
    path (as Apex) does not check and applies the step; the fused O2 master-weight path
    (``amp_optimizers.FusedAdam``) skips it on the device and counts it here, read back from
    the device when this is called.
    """
    state = optimizer_state(optimizer)
    if state is None:
        raise RuntimeError(f"This {type(optimizer).__name__} was not returned by amp.initialize.")
    return state.skipped_steps
