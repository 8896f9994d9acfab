"""Apex's ``fp16_utils`` loss scalers: :class:`LossScaler` (static) and
:class:`DynamicLossScaler`.

Both keep their scale in an :class:`amp_core.LossScaler` (one fp32 tensor on the device of the
gradients), so the unscale kernel, the overflow check and the growth rule are amp-core's. What
differs from amp-core is kept here: the legacy defaults (``init_scale=2**32``,
``scale_window=1000``), the floor of 1 and the absence of a ceiling, and the host-side API
(``has_overflow(params)`` then ``update_scale(overflow)``).

Apex's growth rule ("grow when ``(cur_iter - last_overflow_iter) % scale_window == 0``") grows
after exactly ``scale_window`` consecutive steps without overflow, which is the rule of
amp-core's scaler (``torch._amp_update_scale_``): the two agree step for step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from amp_core import LossScaler as _CoreScaler
from amp_core import ScalerConfig, check_count, check_scale

from ._deprecation import warn_deprecated

__all__ = ["DynamicLossScaler", "LossScaler", "scaler_from_state_dict"]

_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window")


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def grads_have_inf_or_nan(grads: list[torch.Tensor]) -> bool:
    """Whether any tensor of ``grads`` holds an inf or a nan.

    .. note:: One host sync (for all the tensors together).
    """
    if not grads:
        return False
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for group in by_device.values():
        # The inf-norm (max |x|) is inf or nan exactly when a value is; it cannot overflow.
        norms = torch._foreach_norm(group, math.inf)
        flags.append(torch.stack([n.float() for n in norms]).isfinite().all().cpu())
    return not bool(torch.stack(flags).all())


class _ScalerBase:
    """What both legacy scalers share: the amp-core scaler underneath and the host API."""

    _core: _CoreScaler
    dynamic: bool

    @property
    def loss_scale(self) -> float:
        """The current scale (a host sync for a dynamic scale)."""
        return self._core.loss_scale()

    @property
    def cur_scale(self) -> float:
        """Apex's attribute name for :attr:`loss_scale`; assigning sets the scale."""
        return self._core.loss_scale()

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        scale = check_scale(value, "A loss scale")  # 0, negative, inf, nan: refused
        self._core.load_state_dict({"loss_scale": scale, "unskipped": self._core.unskipped()})

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale as a 0-dim fp32 tensor on ``device`` (no host sync)."""
        return self._core.scale_tensor(device)

    def unscale_(self, grads: list[torch.Tensor], found_inf: torch.Tensor, *, check: bool) -> None:
        """Divide ``grads`` in place by the scale; raise ``found_inf`` on inf/nan if ``check``."""
        self._core.unscale_(grads, found_inf, check=check)

    def unscale_with_stash_(
        self,
        params: list[torch.Tensor],
        stash: list[torch.Tensor | None],
        found_inf: torch.Tensor,
        *,
        check: bool,
    ) -> None:
        """Unscale the fresh grads of ``params`` and add back ``stash`` (amp-core's rule)."""
        self._core.unscale_with_stash_(params, stash, found_inf, check=check)

    def scale_gradient(
        self, module: torch.nn.Module, grad_in: tuple[torch.Tensor, ...], grad_out: Any
    ) -> tuple[torch.Tensor, ...]:
        """A backward hook that multiplies the incoming gradients by the scale (Apex's)."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Run ``(loss * loss_scale).backward()``; the loss is scaled in fp32.

        Args:
            loss: The loss tensor.
            retain_graph: Passed to ``backward``.
        """
        scaled = loss.float() * self.scale_tensor(loss.device)
        scaled.backward(retain_graph=retain_graph)


class LossScaler(_ScalerBase):
    """A static loss scale, as Apex's ``apex.fp16_utils.LossScaler``.

    Args:
        scale: The constant scale.

    Example:
        >>> scaler = LossScaler(128.0)
        >>> scaler.backward(loss)  # grads hold 128 * dloss/dparam
    """

    def __init__(self, scale: float = 1) -> None:
        warn_deprecated("LossScaler", "amp_core.amp.initialize(..., loss_scale=<value>)")
        self._setup(scale)

    def _setup(self, scale: float) -> None:
        self.dynamic = False
        scale = check_scale(scale, f"LossScaler(scale={scale!r}): the scale")
        self._core = _CoreScaler.from_config(ScalerConfig(loss_scale=scale))

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Always ``False``: a static scaler does not check (Apex's behaviour)."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        """Plain data that :func:`scaler_from_state_dict` turns back into this scaler."""
        return {"dynamic": False, "cur_scale": self.loss_scale}

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.loss_scale})"


class DynamicLossScaler(_ScalerBase):
    """A dynamic loss scale, as Apex's ``apex.fp16_utils.DynamicLossScaler``.

    On overflow the scale is divided by ``scale_factor`` (never below 1) and the step is to be
    skipped; after ``scale_window`` consecutive steps without overflow it is multiplied by
    ``scale_factor`` (no ceiling, as in Apex).

    Args:
        init_scale: The first scale.
        scale_factor: Growth and backoff factor.
        scale_window: Steps without overflow between two growths.

    Example:
        >>> scaler = DynamicLossScaler(init_scale=2.0**16)
        >>> scaler.backward(loss)
        >>> overflow = scaler.has_overflow(model.parameters())
        >>> scaler.update_scale(overflow)
    """

    def __init__(
        self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000
    ) -> None:
        warn_deprecated("DynamicLossScaler", 'amp_core.amp.initialize(..., loss_scale="dynamic")')
        self._setup(init_scale, scale_factor, scale_window)

    def _setup(self, init_scale: float, scale_factor: float, scale_window: int) -> None:
        # The fp16_utils preset: never below 1 (Apex: max(cur_scale / scale_factor, 1)) and
        # no ceiling.
        config = ScalerConfig.preset(
            "fp16_utils",
            init_scale=init_scale,
            scale_factor=scale_factor,
            scale_window=scale_window,
        )
        self.dynamic = True
        self.scale_factor = config.scale_factor
        self.scale_window = config.scale_window
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self._core = _CoreScaler.from_config(config)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether the gradient of any of ``params`` holds an inf or a nan.

        .. note:: One host sync.
        """
        return grads_have_inf_or_nan(_grads(params))

    def update_scale(self, overflow: bool) -> None:
        """Back off on ``overflow``; grow after ``scale_window`` clean steps."""
        device = self._core.device or torch.device("cpu")
        self.update_scale_tensor(torch.full((), float(bool(overflow)), device=device))
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1

    def update_scale_tensor(self, found_inf: torch.Tensor) -> None:
        """The device half of :meth:`update_scale` (``found_inf``: a 0-dim fp32 flag)."""
        self._core.update_(found_inf)

    def state_dict(self) -> dict[str, Any]:
        """Plain data that :func:`scaler_from_state_dict` turns back into this scaler."""
        return {
            "dynamic": True,
            "cur_scale": self.loss_scale,
            "unskipped": self._core.unskipped(),
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
        }

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(loss_scale={self.loss_scale}, scale_factor={self.scale_factor}, "
            f"scale_window={self.scale_window})"
        )


def make_static(scale: float) -> LossScaler:
    """A :class:`LossScaler` built without the deprecation warning (for internal use)."""
    scaler = LossScaler.__new__(LossScaler)
    scaler._setup(scale)
    return scaler


def make_dynamic(args: dict[str, Any] | None) -> DynamicLossScaler:
    """A :class:`DynamicLossScaler` from ``dynamic_loss_args``, without the warning.

    Raises:
        ValueError: for keys the constructor does not take.
    """
    args = dict(args or {})
    unknown = sorted(set(args) - set(_DYNAMIC_ARGS))
    if unknown:
        raise ValueError(
            f"dynamic_loss_args has unknown key(s) {unknown}; DynamicLossScaler accepts only "
            f"{list(_DYNAMIC_ARGS)}. Example: dynamic_loss_args={{'init_scale': 2**16}}."
        )
    preset = ScalerConfig.preset("fp16_utils")
    scaler = DynamicLossScaler.__new__(DynamicLossScaler)
    scaler._setup(
        args.get("init_scale", preset.init_scale),
        args.get("scale_factor", preset.scale_factor),
        args.get("scale_window", preset.scale_window),
    )
    return scaler


_STATIC_STATE_KEYS = ("dynamic", "cur_scale")
_DYNAMIC_STATE_KEYS = (
    "dynamic",
    "cur_scale",
    "unskipped",
    "cur_iter",
    "last_overflow_iter",
    "scale_factor",
    "scale_window",
)


def scaler_from_state_dict(
    state: Any, where: str = "loss_scaler"
) -> LossScaler | DynamicLossScaler:
    """Rebuild a scaler saved by ``state_dict()`` (a scaler object is returned as it is).

    Every field is checked before the scaler is built: a wrong type, a scale of 0, negative,
    inf or nan, a negative counter, a missing or an unknown key raises, naming the key.

    Args:
        state: What ``state_dict()`` returned.
        where: How errors name ``state``.

    Raises:
        TypeError: ``state`` is not a saved scaler, or a field has the wrong type.
        ValueError: a field is missing, unknown, or has an impossible value.
    """
    if isinstance(state, (LossScaler, DynamicLossScaler)):
        return state
    if not isinstance(state, dict):
        raise TypeError(
            f"{where}: expected a loss scaler state saved by FP16_Optimizer.state_dict(), got "
            f"{type(state).__name__}. Save checkpoints with optimizer.state_dict()."
        )
    if "dynamic" not in state:
        raise ValueError(
            f'{where} has no key "dynamic"; pass the loss scaler state saved by '
            "FP16_Optimizer.state_dict()."
        )
    dynamic = state["dynamic"]
    if not isinstance(dynamic, bool):
        raise TypeError(f'{where}["dynamic"] must be a bool, got {dynamic!r}.')
    keys = _DYNAMIC_STATE_KEYS if dynamic else _STATIC_STATE_KEYS
    missing = [k for k in keys if k not in state]
    unknown = [k for k in state if k not in keys]
    if missing or unknown:
        raise ValueError(
            f"{where} must have exactly the keys {list(keys)}; missing {missing}, unknown "
            f"{unknown}. Pass the dict saved by FP16_Optimizer.state_dict()."
        )
    scale = check_scale(state["cur_scale"], f'{where}["cur_scale"]')
    if not dynamic:
        return make_static(scale)
    factor = state["scale_factor"]
    if (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not 1 < factor < math.inf
    ):
        raise ValueError(f'{where}["scale_factor"] must be a finite number > 1, got {factor!r}.')
    window = check_count(state["scale_window"], f'{where}["scale_window"]', minimum=1)
    cur_iter = check_count(state["cur_iter"], f'{where}["cur_iter"]')
    last_overflow = check_count(
        state["last_overflow_iter"], f'{where}["last_overflow_iter"]', minimum=-1
    )
    if last_overflow >= cur_iter:
        raise ValueError(
            f'{where}["last_overflow_iter"]={last_overflow} must be below '
            f'["cur_iter"]={cur_iter} (or -1 before any overflow).'
        )
    scaler = make_dynamic({"scale_factor": float(factor), "scale_window": window})
    scaler._core.load_state_dict({"loss_scale": scale, "unskipped": state["unskipped"]}, where)
    scaler.cur_iter = cur_iter
    scaler.last_overflow_iter = last_overflow
    return scaler
