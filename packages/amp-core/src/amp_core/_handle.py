"""``amp.scale_loss`` and the other per-step entry points."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ._optimizer import OptimizerAmpState, optimizer_state
from ._state import AmpSession, registry

__all__ = ["load_state_dict", "master_params", "scale_loss", "skipped_steps", "state_dict"]

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
    the fp32 master grads, which :func:`master_params` yields). With dynamic scaling an
    overflow lowers the scale and makes the next ``optimizer.step()`` a no-op.

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

    if not owner.props.master_weights and scaler.is_unit_static:
        # Nothing to scale or copy (O0, O3): Apex's fast path.
        yield loss.float()
        if casting is not None:
            casting.clear_cache()
        return

    if not delay_unscale:
        for state in states:
            if not state.grads_scaled:
                state.prepare_backward()
    scale = scaler.scale_tensor(loss.device)
    yield loss.float() * scale

    if delay_unscale:
        for state in states:
            state.grads_scaled = True
    else:
        check = scaler.dynamic and not delay_overflow_check
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        # A fused master-weight optimizer alone may take the scaled grads as they are: its
        # step unscales, checks and updates the scale (see _fused_master).
        defer_loss_id = loss_id if len(states) == 1 and not delay_overflow_check else None
        deferred = False
        for state in states:
            deferred = state.post_backward(scaler, found_inf, check, defer_loss_id) or deferred
            state.grads_scaled = False
        if not deferred:
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


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers of the current ``amp.initialize`` call, as Apex's ``amp.state_dict``.

    Returns:
        ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    .. note:: Reads the scales from the device: a host sync.
    """
    session = registry.current
    if session is None:
        raise RuntimeError("amp.state_dict() was called before amp.initialize().")
    out: dict[str, Any] = {} if destination is None else destination
    for idx, scaler in enumerate(session.scalers):
        out[f"loss_scaler{idx}"] = scaler.state_dict()
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore the loss scalers saved by :func:`state_dict` into the current call's scalers.

    Raises:
        RuntimeError: before ``amp.initialize``, or for keys that are not loss scalers.
    """
    session = registry.current
    if session is None:
        raise RuntimeError("amp.load_state_dict() was called before amp.initialize().")
    unexpected = [key for key in state if not key.startswith("loss_scaler")]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected)
            + ". "
        )
    if not session.props.enabled:
        return
    if len(state) != len(session.scalers):
        from ._frontend import logger

        logger.warning(
            "state_dict contains %d entries, while %d loss_scalers are used",
            len(state),
            len(session.scalers),
        )
    for idx, key in enumerate(state):
        if idx >= len(session.scalers):
            break
        session.scalers[idx].load_state_dict(state[key])


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
