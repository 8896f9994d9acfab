"""The step of a mixed-precision optimizer: its one host read, or a fused step that needs none.

:func:`read_overflow` is the one host sync of an ordinary step (the overflow flag, with the
current loss scales in the same read); :func:`fused_master_step` is the step of an optimizer that
keeps the masters itself and skips on the device instead. Both serve every mixed-precision
optimizer of the toolkit, with :class:`~amp_core._master_weights.MasterWeights`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._fused_master import FusedMasterWeightOptimizer
from ._scaler import LossScaler

__all__ = ["fused_master_step", "read_overflow"]


def read_overflow(
    found_inf: Tensor, scalers: Sequence[LossScaler] = ()
) -> tuple[bool, list[float]]:
    """The one host sync of a step: the overflow flag, and with it the current scales.

    Each scaler is told its value (:meth:`LossScaler.note_host_scale`).

    Returns:
        Whether ``found_inf`` is set, and the scales of ``scalers`` in order.
    """
    if not scalers:
        return bool(found_inf.item()), []
    # amp's own bookkeeping, outside the O1 policy (stack would go through its Python kernel).
    with torch._C._DisableAutocast():
        values = [found_inf.float().reshape(())]
        values += [
            s.scale_tensor(s.device or found_inf.device).to(found_inf.device) for s in scalers
        ]
        flag, *scales = torch.stack(values).tolist()
    for scaler, value in zip(scalers, scales, strict=True):
        scaler.note_host_scale(value)
    return bool(flag), scales


def fused_master_step(
    optimizer: FusedMasterWeightOptimizer, scaler: LossScaler | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """A step of an optimizer that keeps the masters itself, skipped on the device on overflow.

    The optimizer reads the scaled gradients, unscales them by ``1 / scale``, checks them, and
    steps the masters and writes the model in one pass, or changes nothing when a gradient holds
    an inf or a nan. The scaler is then updated from the flag (nothing is read back).

    Args:
        optimizer: The fused master-weight optimizer.
        scaler: The scale the gradients carry, or ``None`` when they are unscaled already.
        device: Where the flag (and the scale) live.

    Returns:
        ``(found_inf, inv_scale)``: the device overflow flag and the inverse scale used.
    """
    if scaler is None:
        inv_scale = torch.ones((), dtype=torch.float32, device=device)
    else:
        inv_scale = scaler.scale_tensor(device).double().reciprocal().float()
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    optimizer.amp_fused_master_step(inv_scale, found_inf)
    if scaler is not None:
        # With the updates earlier blocks of this step left pending, once.
        scaler.note_update_(found_inf)
        scaler.flush_update_()
    return found_inf, inv_scale
