"""``amp.scale_loss`` and the other per-step entry points."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._opt_levels import OptLevel
from ._optimizer import OptimizerAmpState, optimizer_state
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
    states = []
    for optimizer in items:
        state = optimizer_state(optimizer)
        if state is None:
            raise RuntimeError(
                f"amp.scale_loss got a {type(optimizer).__name__} that amp.initialize did not "
                "return. Pass the optimizer(s) returned by amp.initialize."
            )
        state.require_open("amp.scale_loss")
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
) -> Iterator[torch.Tensor]:
    """Yield ``loss * loss_scale`` for ``backward()``; unscale the gradients on exit.

    On exit the gradients of the params the optimizer(s) step hold unscaled values (for O2,
    the fp32 master grads, which :func:`master_params` yields). At O1, O2 and O3, with any loss
    scale, a gradient holding an inf or a nan (before or after unscaling) makes the next
    ``optimizer.step()`` a no-op; a dynamic scale is lowered too (not below its floor).

    Args:
        loss: The loss tensor.
        optimizers: The optimizer, or list of optimizers, returned by ``amp.initialize``
            that will step the gradients of this backward.
        loss_id: Which loss scaler to use, ``0 <= loss_id < num_losses``.
        model: Unused; kept for Apex compatibility.
        delay_unscale: Leave the gradients scaled (gradient accumulation, several
            backward passes): the last ``scale_loss`` before ``step()`` must not delay.
        delay_overflow_check: Unscale, but neither update the scale nor skip a step.

    Raises:
        RuntimeError: before ``amp.initialize``, or for an optimizer it did not return.
        ValueError: for a ``loss_id`` out of range.

    Example:
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
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

    if not owner.props.master_weights and scaler.is_unit_static:
        # Nothing to scale or copy (O0, O3): Apex's fast path, with the overflow check alone.
        yield loss.float()
        if not delay_unscale:
            found_inf = torch.zeros((), dtype=torch.float32, device=loss.device)
            for state in states:
                state.end_unit_backward(scaler, found_inf, check=check)
            if check:
                for state in states:
                    state.note_overflow_check(loss_id, found_inf)
        if casting is not None:
            casting.clear_cache()
        return

    for state in states:
        state.begin_backward(delay_unscale=delay_unscale)
    scale = scaler.scale_tensor(loss.device)
    yield loss.float() * scale

    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    # A fused master-weight optimizer alone may take the scaled grads as they are: its
    # step unscales, checks and updates the scale (see _fused_master).
    defer_loss_id = loss_id if len(states) == 1 and not delay_overflow_check else None
    deferred = False
    for state in states:
        deferred = (
            state.end_backward(
                scaler,
                found_inf,
                check=check,
                delay_unscale=delay_unscale,
                defer_loss_id=defer_loss_id,
            )
            or deferred
        )
    if not (delay_unscale or deferred):
        if not delay_overflow_check:
            scaler.update_(found_inf)
        if check:
            for state in states:
                state.note_overflow_check(loss_id, found_inf)
    if casting is not None:
        casting.clear_cache()  # the weights are about to change


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


def _prefix(index: int) -> str:
    """Key prefix of the ``index``-th live session: none for the first (Apex's format)."""
    return "" if index == 0 else f"session{index}."


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers of every live ``amp.initialize`` call, as Apex's ``amp.state_dict``.

    A single call (the usual case) gives Apex's format. When ``amp.initialize`` was called
    several times (once per model) and the optimizers of the earlier calls are still in use,
    the scalers of the ``i``-th call (``i >= 1``, in call order) follow under the keys
    ``"session<i>.loss_scaler<j>"``, so that no model's scale is lost.

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
    for index, session in enumerate(registry.live_sessions()):
        for idx, scaler in enumerate(session.scalers):
            out[f"{_prefix(index)}loss_scaler{idx}"] = scaler.state_dict()
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore the loss scalers saved by :func:`state_dict` into the live ``amp.initialize``
    calls (one per saved call, in call order, each with as many losses as were saved).

    Every entry is validated before anything is loaded: an error leaves every scaler as it was.
    A scale outside ``[min_loss_scale, max_loss_scale]`` of the new call is brought within it
    (with a warning), as is an ``unskipped`` count not below the scale window.

    Raises:
        RuntimeError: before ``amp.initialize``, or for a key that is not a loss scaler (as
            Apex).
        TypeError: ``state`` is not a dict, or a field has the wrong type (a scale that is not
            a number, a count that is not an int).
        ValueError: a missing or extra loss scaler (the saved
            number of calls or of ``num_losses`` differs from this run's), a missing or unknown
            field, a loss scale of 0, negative, inf or nan, or a negative count.
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
    sessions = registry.live_sessions()
    expected = [
        (f"{_prefix(index)}loss_scaler{idx}", scaler)
        for index, session in enumerate(sessions)
        if session.props.enabled
        for idx, scaler in enumerate(session.scalers)
    ]
    ignored = {  # a disabled call (enabled=False) keeps nothing and ignores its entries
        _prefix(index) for index, session in enumerate(sessions) if not session.props.enabled
    }
    wanted = {key for key, _ in expected}
    missing = [key for key in wanted if key not in state]
    extra = [
        key
        for key in state
        if key not in wanted and (key.rsplit("loss_scaler", 1)[0] not in ignored)
    ]
    if missing or extra:
        counts = [len(s.scalers) for s in sessions]
        raise ValueError(
            f"amp.load_state_dict: the checkpoint does not match the loss scalers of this run "
            f"(missing {sorted(missing)}, unexpected {sorted(extra)}). This run has "
            f"{len(sessions)} live amp.initialize call(s) with num_losses {counts}; a "
            "checkpoint loads into a run that calls amp.initialize as the run that saved it "
            "did (same number of calls, in the same order, with the same num_losses). Calls "
            "whose optimizers are still referenced count as live: delete them first."
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
