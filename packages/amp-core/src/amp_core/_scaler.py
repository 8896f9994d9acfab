"""The loss scaler: static or dynamic, with its state on the device.

The scale, the count of unskipped steps and the overflow flag are tensors on the device of the
gradients, so unscaling, the overflow check and the scale update launch kernels without waiting
for them. The host reads the overflow flag once per optimizer step, to decide whether to skip it.
This module keeps the scale and its bookkeeping; :mod:`amp_core._overflow_checks` does the work
on the gradients (unscaling, checking, scaling).

A dynamic scale stays within ``[floor, ceiling]``: the floor is ``min_loss_scale`` when given,
else :data:`DEFAULT_MIN_LOSS_SCALE`, so the scale never underflows to zero and ``1/scale`` stays
finite. Unscaling multiplies by ``1/scale``; when the scale may be below one that product can
overflow, so the unscaled gradients are checked as well (an extra read of them, only then).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

# The gradient side (unscale, check, scale) lives in _overflow_checks; its names that were
# imported from this module still are.
from ._overflow_checks import (
    _NO_FUSED_UNSCALE,
    coalesce_half_sparse_grads,
    group_grads,
    scale_grads_,
    unscale_groups_,
)
from ._scaler_config import DEFAULT_MIN_LOSS_SCALE, ScalerConfig, check_count, check_scale

__all__ = [
    "DEFAULT_MIN_LOSS_SCALE",
    "LossScaler",
    "ScalerConfig",
    "_NO_FUSED_UNSCALE",
    "check_count",
    "check_scale",
    "coalesce_half_sparse_grads",
    "scale_grads_",
]

logger = logging.getLogger(__name__)

# The largest power of two in float32: a ceiling of "no ceiling" (inf) keeps the scale finite.
_MAX_SCALE = 2.0**127
_STATE_KEYS = ("loss_scale", "unskipped")
_MAX_COUNT = torch.iinfo(torch.int32).max  # the device counter is int32


class LossScaler:
    """One loss's scale, as Apex's ``apex.amp.scaler.LossScaler``.

    Dynamic scaling starts at ``init_scale``, is multiplied by ``scale_factor`` after
    ``scale_window`` consecutive steps without overflow (up to ``max_loss_scale``) and divided by
    it on every overflow, down to a floor: ``min_loss_scale`` when given, else
    :data:`DEFAULT_MIN_LOSS_SCALE` (``2**-24``; Apex had no floor, and a long run of overflows
    took the scale to 0, whose reciprocal wrote nan into the weights).

    Args:
        loss_scale: A positive finite number for a static scale, or ``"dynamic"``.
        init_scale: The first dynamic scale (brought within the floor and the ceiling).
        scale_factor: Growth and backoff factor.
        scale_window: Unskipped steps between two growths.
        min_loss_scale: Floor of the dynamic scale, or ``None`` for the default floor.
        max_loss_scale: Ceiling of the dynamic scale (``inf``: none below float32's
            largest power of two).

    Raises:
        TypeError, ValueError: for a value :class:`ScalerConfig` refuses (a static scale that is
            not positive and finite, ``scale_factor <= 1``...); :meth:`from_config` takes one.
    """

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self._setup(
            ScalerConfig(
                loss_scale,  # type: ignore[arg-type]
                init_scale,
                scale_factor,
                scale_window,
                min_loss_scale,
                max_loss_scale,
            )
        )

    @classmethod
    def from_config(cls, config: ScalerConfig) -> LossScaler:
        """A scaler with the settings of ``config`` (e.g. ``ScalerConfig.preset("amp")``)."""
        if not isinstance(config, ScalerConfig):
            raise TypeError(
                f"LossScaler.from_config takes a ScalerConfig, got {type(config).__name__}."
            )
        scaler = cls.__new__(cls)
        scaler._setup(config)
        return scaler

    def _setup(self, config: ScalerConfig) -> None:
        self.config = config
        self.dynamic = config.dynamic
        self.scale_factor = config.scale_factor
        self.scale_window = config.scale_window
        self.min_loss_scale = config.min_loss_scale
        self.max_loss_scale = config.max_loss_scale
        if self.dynamic:
            self._initial_scale = min(max(config.init_scale, self.floor), self.ceiling)
        else:
            self._initial_scale = float(config.loss_scale)
        # A lower bound of the device scale, known on the host without a sync: exact after a
        # load or a read-back, divided by the factor at every update. Below one, unscaling can
        # overflow and the unscaled gradients are checked too.
        self._low_hint = self._initial_scale
        # Device state, created on the first device that asks for it.
        self._scale: torch.Tensor | None = None
        self._unskipped: torch.Tensor | None = None
        self._pending: tuple[float, int] | None = None  # from load_state_dict before first use
        self._static_unskipped = 0  # a static scale's step count lives on the host
        self._static_inv: torch.Tensor | None = None  # 1/scale of a static scale, once made
        # Overflow flags of blocks whose update waits for the step (note_update_), summed.
        self._pending_inf: torch.Tensor | None = None
        # How many times the device scale may have changed: gradients that took the scale
        # at one count carry the current scale while the count is the same.
        self.version = 0

    # -- device state -----------------------------------------------------------------------

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale as a one-element fp32 tensor on ``device`` (moved there on first use)."""
        if self._scale is None:
            scale, unskipped = self._pending or (self._initial_scale, 0)
            # 0-dim, as GradScaler's: a 0-dim loss times the scale stays 0-dim.
            self._scale = torch.full((), scale, dtype=torch.float32, device=device)
            self._unskipped = torch.full((), unskipped, dtype=torch.int32, device=device)
            self._pending = None
        elif self._scale.device != device:
            self._scale = self._scale.to(device)
            assert self._unskipped is not None
            self._unskipped = self._unskipped.to(device)
        return self._scale

    def inv_scale_tensor(self, device: torch.device) -> torch.Tensor:
        """``1 / scale`` as a 0-dim fp32 tensor on ``device`` (computed in fp64, as the fused
        optimizers do); kept between steps for a static scale, whose value does not change."""
        cached = self._static_inv
        if cached is not None and cached.device == device:
            return cached
        scale = self.scale_tensor(device)
        # amp's own arithmetic, outside the O1 policy (which would widen it through Python).
        with torch._C._DisableAutocast():
            inv = scale.double().reciprocal().float()
        if not self.dynamic:
            self._static_inv = inv
        return inv

    @property
    def is_unit_static(self) -> bool:
        """A static scale of 1.0: there is nothing to scale or unscale (the overflow check, when
        asked for, only reads the gradients)."""
        if self.dynamic:
            return False
        return (self._pending or (self._initial_scale, 0))[0] == 1.0

    @property
    def device(self) -> torch.device | None:
        return None if self._scale is None else self._scale.device

    @property
    def floor(self) -> float:
        """The lowest value of a dynamic scale."""
        if self.min_loss_scale is not None:
            return float(self.min_loss_scale)
        return min(DEFAULT_MIN_LOSS_SCALE, self.ceiling)

    @property
    def ceiling(self) -> float:
        """The highest value of a dynamic scale."""
        return min(self.max_loss_scale, _MAX_SCALE)

    def note_host_scale(self, value: float) -> None:
        """Tell the scaler its current value, read back by a host sync made anyway."""
        self._low_hint = value

    # -- the algorithm ----------------------------------------------------------------------

    def unscale_(
        self, grads: Iterable[torch.Tensor], found_inf: torch.Tensor, *, check: bool = True
    ) -> None:
        """Multiply ``grads`` in place by 1/scale; set ``found_inf`` on any inf or nan.

        With ``check``, a gradient counts as overflowed when it is not finite before or after
        unscaling (the latter is possible only for a scale below one, and only then checked).
        Sparse COO gradients are unscaled and checked through their values.

        ``found_inf`` is a 0-dim fp32 tensor; it is only ever raised, never cleared here.
        DTensor (FSDP2) gradients are unscaled through their local shards, and with ``check``
        the flag is then all-reduced over their meshes, so every rank makes the same decision
        (a collective: every rank must call this with its shards of the same gradients).
        """
        unit = not self.dynamic and self._initial_scale == 1.0
        if not check and unit:
            return  # a static scale of one: nothing to undo
        groups, meshes = group_grads(grads)
        if not groups:
            return
        inv_scale = None if unit else self.inv_scale_tensor(found_inf.device)
        unscale_groups_(
            groups,
            meshes,
            found_inf,
            inv_scale,
            check=check,
            check_output=check and self._low_hint < 1.0,
        )

    def unscale_with_stash_(
        self,
        params: Sequence[torch.Tensor],
        stash: Sequence[torch.Tensor | None],
        found_inf: torch.Tensor,
        *,
        check: bool = True,
    ) -> None:
        """Unscale the fresh grads of ``params``, then add back the grads set aside before the
        backward (Apex's ``unscale_with_stashed``).

        Args:
            params: Params whose ``.grad`` holds only this backward's (scaled) gradient.
            stash: One entry per param: its unscaled gradient from before, or ``None``.
            found_inf: As in :meth:`unscale_`.
            check: As in :meth:`unscale_`.
        """
        coalesce_half_sparse_grads(params)
        self.unscale_([p.grad for p in params if p.grad is not None], found_inf, check=check)
        for param, stashed in zip(params, stash, strict=True):
            if stashed is None:
                continue
            if param.grad is None:
                param.grad = stashed
            else:
                param.grad.add_(stashed)

    def note_update_(self, found_inf: torch.Tensor) -> None:
        """Remember an update owed for ``found_inf``; :meth:`flush_update_` applies the updates
        owed, once, with the overflow of any of them.

        ``amp.scale_loss`` updates the scale once per step (as torch's ``GradScaler``), not at
        each block's exit as Apex did: under a data-parallel wrapper, a block whose
        gradients were not all-reduced (``no_sync()``) sees only its rank's overflow, and an
        update then would give the ranks different scales. Their flags are added to the
        gradients of the block the wrapper reduces, which every rank then checks alike.
        """
        flag = found_inf.detach().clone()
        pending = self._pending_inf
        self._pending_inf = flag if pending is None else pending.add_(flag.to(pending.device))

    def flush_update_(self) -> None:
        """Apply the update owed by :meth:`note_update_` calls, if any (no host sync)."""
        pending, self._pending_inf = self._pending_inf, None
        if pending is not None:
            self.update_(pending)

    def update_(self, found_inf: torch.Tensor) -> None:
        """Apex's update, on the device: backoff on overflow (not below the floor), growth after
        the window (not above the ceiling).

        A static scale never changes, but counts its steps as Apex's does.
        """
        if not self.dynamic:
            self._static_unskipped += 1
            return
        self.version += 1
        scale = self.scale_tensor(found_inf.device)
        assert self._unskipped is not None
        torch._amp_update_scale_(
            scale,
            self._unskipped,
            found_inf,
            self.scale_factor,
            1.0 / self.scale_factor,
            self.scale_window,
        )
        scale.clamp_(min=self.floor, max=self.ceiling)
        self._low_hint = max(self.floor, self._low_hint / self.scale_factor)

    # -- host view (syncs) --------------------------------------------------------------------

    def loss_scale(self) -> float:
        """The current scale as a Python float.

        .. note:: Reads the device tensor: a host sync. Applies a pending update first.
        """
        self.flush_update_()
        if not self.dynamic:
            return self._initial_scale  # kept on the host too: no sync
        if self._scale is None:
            return (self._pending or (self._initial_scale, 0))[0]
        value = float(self._scale.item())
        self._low_hint = value
        return value

    def unskipped(self) -> int:
        """Steps since the last overflow or growth. Host sync, as :meth:`loss_scale`."""
        self.flush_update_()
        if not self.dynamic:
            return self._static_unskipped
        if self._unskipped is None:
            return (self._pending or (self._initial_scale, 0))[1]
        return int(self._unskipped.item())

    def state_dict(self) -> dict[str, float | int]:
        return {"loss_scale": self.loss_scale(), "unskipped": self.unskipped()}

    def check_state_dict(self, state: Any, where: str = "state_dict") -> tuple[float, int]:
        """Validate ``state`` (as :meth:`state_dict` returns it) without loading it.

        Args:
            state: ``{"loss_scale": positive finite number, "unskipped": int >= 0}``.
            where: How the error names ``state`` (e.g. ``state_dict["loss_scaler0"]``).

        Returns:
            ``(loss_scale, unskipped)`` as :meth:`load_state_dict` would set them: a dynamic
            scale brought within ``[floor, ceiling]`` and ``unskipped`` below ``scale_window``
            (a checkpoint of a run with other bounds), each with a warning.

        Raises:
            TypeError: ``state`` is not a dict, or a field has the wrong type.
            ValueError: a field is missing, an unknown one is present, or a field has a value
                no scaler can have (a scale of 0, negative, inf or nan; a negative count).
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"{where} must be a dict with the keys {list(_STATE_KEYS)}, got "
                f"{type(state).__name__}. Pass the dict saved by amp.state_dict()."
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = [k for k in state if k not in _STATE_KEYS]
        if missing or unknown:
            raise ValueError(
                f"{where} must have exactly the keys {list(_STATE_KEYS)}; missing {missing}, "
                f"unknown {unknown}. Pass the dict saved by amp.state_dict()."
            )
        scale = check_scale(state["loss_scale"], f'{where}["loss_scale"]')
        unskipped = check_count(state["unskipped"], f'{where}["unskipped"]', maximum=_MAX_COUNT)
        if self.dynamic:
            bounded = min(max(scale, self.floor), self.ceiling)
            if bounded != scale:
                logger.warning(
                    "%s: loss_scale %s is outside [%s, %s] of this scaler; using %s.",
                    where,
                    scale,
                    self.floor,
                    self.ceiling,
                    bounded,
                )
                scale = bounded
            if unskipped >= self.scale_window:
                logger.warning(
                    "%s: unskipped %d is not below scale_window %d; the scale grows at the "
                    "next step without overflow.",
                    where,
                    unskipped,
                    self.scale_window,
                )
                unskipped = self.scale_window - 1
        return scale, unskipped

    def load_state_dict(self, state: Any, where: str = "state_dict") -> None:
        """Load :meth:`state_dict`'s output, validated first (see :meth:`check_state_dict`).

        Raises:
            TypeError, ValueError: as :meth:`check_state_dict`; nothing is loaded then.
        """
        self.load_checked(*self.check_state_dict(state, where))

    def load_checked(self, scale: float, unskipped: int) -> None:
        """Set the values :meth:`check_state_dict` returned (cannot fail)."""
        if not self.dynamic:
            self._initial_scale = scale  # the host copy of a static scale
            self._static_unskipped = unskipped
            self._static_inv = None
        self._low_hint = scale
        self._pending_inf = None  # updates owed to the scale that is replaced
        self.version += 1
        if self._scale is None:
            self._pending = (scale, unskipped)
        else:
            assert self._unskipped is not None
            self._scale.fill_(scale)
            self._unskipped.fill_(unskipped)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self.loss_scale()})"
