"""The loss scaler: static or dynamic, with its state on the device.

The scale, the count of unskipped steps and the overflow flag are tensors on the device of the
gradients, so unscaling, the overflow check and the scale update launch kernels without waiting
for them. The host reads the overflow flag once per optimizer step, to decide whether to skip it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

__all__ = ["LossScaler"]

logger = logging.getLogger(__name__)


class LossScaler:
    """One loss's scale, as Apex's ``apex.amp.scaler.LossScaler``.

    Dynamic scaling starts at ``init_scale``, is multiplied by ``scale_factor`` after
    ``scale_window`` consecutive steps without overflow (up to ``max_loss_scale``) and divided by
    it on every overflow (down to ``min_loss_scale`` when given).

    Args:
        loss_scale: A positive number for a static scale, or ``"dynamic"``.
        init_scale: The first dynamic scale.
        scale_factor: Growth and backoff factor.
        scale_window: Unskipped steps between two growths.
        min_loss_scale: Floor of the dynamic scale, or ``None``.
        max_loss_scale: Ceiling of the dynamic scale.
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
        self.dynamic = loss_scale == "dynamic"
        first = init_scale if self.dynamic else float(loss_scale)
        self._initial_scale = min(first, max_loss_scale) if self.dynamic else first
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = float(max_loss_scale)
        # Device state, created on the first device that asks for it.
        self._scale: torch.Tensor | None = None
        self._unskipped: torch.Tensor | None = None
        self._pending: tuple[float, int] | None = None  # from load_state_dict before first use
        self._static_unskipped = 0  # a static scale's step count lives on the host

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

    @property
    def is_unit_static(self) -> bool:
        """A static scale of 1.0: there is nothing to scale or check (no host sync)."""
        if self.dynamic:
            return False
        return (self._pending or (self._initial_scale, 0))[0] == 1.0

    @property
    def device(self) -> torch.device | None:
        return None if self._scale is None else self._scale.device

    # -- the algorithm ----------------------------------------------------------------------

    def unscale_(
        self, grads: Iterable[torch.Tensor], found_inf: torch.Tensor, *, check: bool = True
    ) -> None:
        """Multiply ``grads`` in place by 1/scale; set ``found_inf`` on any inf or nan.

        ``found_inf`` is a 0-dim fp32 tensor; it is only ever raised, never cleared here.
        """
        if not check and not self.dynamic and self._initial_scale == 1.0:
            return  # a static scale of one: nothing to undo
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            groups[(g.device, g.dtype)].append(g)
        if not groups:
            return
        scale = self.scale_tensor(found_inf.device)
        for (device, _), group in groups.items():
            inv_scale = scale.double().reciprocal().float().to(device, non_blocking=True)
            if check:
                local_inf = (
                    found_inf
                    if device == found_inf.device
                    else torch.zeros_like(found_inf, device=device)
                )
                torch._amp_foreach_non_finite_check_and_unscale_(group, local_inf, inv_scale)
                if local_inf is not found_inf:
                    found_inf.add_(local_inf.to(found_inf.device, non_blocking=True))
            else:
                torch._foreach_mul_(group, inv_scale)

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
        self.unscale_([p.grad for p in params if p.grad is not None], found_inf, check=check)
        for param, stashed in zip(params, stash, strict=True):
            if stashed is None:
                continue
            if param.grad is None:
                param.grad = stashed
            else:
                param.grad.add_(stashed)

    def update_(self, found_inf: torch.Tensor) -> None:
        """Apex's update, on the device: backoff on overflow, growth after the window.

        A static scale never changes, but counts its steps as Apex's does.
        """
        if not self.dynamic:
            self._static_unskipped += 1
            return
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
        scale.clamp_(min=self.min_loss_scale or 0.0, max=self.max_loss_scale)

    # -- host view (syncs) --------------------------------------------------------------------

    def loss_scale(self) -> float:
        """The current scale as a Python float.

        .. note:: Reads the device tensor: a host sync.
        """
        if not self.dynamic:
            return self._initial_scale  # kept on the host too: no sync
        if self._scale is None:
            return (self._pending or (self._initial_scale, 0))[0]
        return float(self._scale.item())

    def unskipped(self) -> int:
        """Steps since the last overflow or growth. Host sync, as :meth:`loss_scale`."""
        if not self.dynamic:
            return self._static_unskipped
        if self._unskipped is None:
            return (self._pending or (self._initial_scale, 0))[1]
        return int(self._unskipped.item())

    def state_dict(self) -> dict[str, float | int]:
        return {"loss_scale": self.loss_scale(), "unskipped": self.unskipped()}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        scale, unskipped = float(state["loss_scale"]), int(state["unskipped"])
        if not self.dynamic:
            self._initial_scale = scale  # the host copy of a static scale
            self._static_unskipped = unskipped
        if self._scale is None:
            self._pending = (scale, unskipped)
        else:
            assert self._unskipped is not None
            self._scale.fill_(scale)
            self._unskipped.fill_(unskipped)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self.loss_scale()})"
