"""Reference ``amp_C.update_scale_hysteresis``: a dynamic loss-scale update with hysteresis.

Apex's ``csrc/update_scale_hysteresis.cu`` (used by Megatron-style grad scalers): like
``torch._amp_update_scale_``, but the scale backs off only after ``hysteresis`` consecutive
steps with an inf/nan. Everything stays on the device (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["update_scale_hysteresis"]

_OP = "update_scale_hysteresis"


def _check_one(name: str, t: Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{_OP}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.numel() != 1:
        raise ValueError(
            f"{_OP}: {name} must be a one-element {str(dtype).removeprefix('torch.')} tensor, "
            f"got dtype {t.dtype} with {t.numel()} elements"
        )
    if t.device != device:
        raise RuntimeError(
            f"{_OP}: {name} is on {t.device} but current_scale is on {device}; "
            "keep the scaler's tensors on one device"
        )


@torch.no_grad()
def update_scale_hysteresis(
    current_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> Tensor:
    """Update the loss scale and its trackers in place, as Apex's kernel does.

    With ``found = found_inf > 0``::

        if found: hysteresis_tracker -= 1
        if found and hysteresis_tracker > 0:        # tolerated: keep the scale
            growth_tracker = 0
        else:
            if found_inf != 0:
                current_scale *= backoff_factor;   growth_tracker = 0
            elif growth_tracker + 1 == growth_interval:
                current_scale *= growth_factor (kept only if finite);  growth_tracker = 0
            else:
                growth_tracker += 1
            if found_inf <= 0: hysteresis_tracker = hysteresis

    The products are taken in float64 and rounded to float32, as the kernel does; a backoff
    may underflow to 0 (no lower bound, as in Apex).

    Args:
        current_scale: One-element float32 tensor, the loss scale; updated in place.
        growth_tracker: One-element int32 tensor, successful steps since the last change.
        hysteresis_tracker: One-element int32 tensor, overflows still tolerated.
        found_inf: One-element float32 tensor, nonzero when this step overflowed.
        growth_factor: Multiplier after ``growth_interval`` successful steps.
        backoff_factor: Multiplier after an overflow that exhausts the hysteresis.
        growth_interval: Successful steps between growths.
        hysteresis: Value the hysteresis tracker is reset to after a successful step.

    Returns:
        ``current_scale`` (the same tensor).

    Raises:
        TypeError: An argument that must be a tensor is not.
        ValueError: A tensor has the wrong dtype or size.
        RuntimeError: The tensors are on different devices.
    """
    if not isinstance(current_scale, Tensor):
        raise TypeError(
            f"{_OP}: current_scale must be a tensor, got {type(current_scale).__name__}"
        )
    device = current_scale.device
    _check_one("current_scale", current_scale, torch.float32, device)
    _check_one("growth_tracker", growth_tracker, torch.int32, device)
    _check_one("hysteresis_tracker", hysteresis_tracker, torch.int32, device)
    _check_one("found_inf", found_inf, torch.float32, device)

    scale = current_scale.reshape(())
    growth = growth_tracker.reshape(())
    hyst = hysteresis_tracker.reshape(())
    found = found_inf.reshape(())
    positive = found > 0
    nonzero = found != 0

    hyst_after = torch.where(positive, hyst - 1, hyst)
    tolerated = positive & (hyst_after > 0)
    successful = growth + 1
    grow = ~nonzero & (successful == growth_interval)
    grown = (scale.double() * growth_factor).float()
    backed_off = (scale.double() * backoff_factor).float()
    new_scale = torch.where(
        nonzero, backed_off, torch.where(grow & torch.isfinite(grown), grown, scale)
    )
    new_growth = torch.where(nonzero | grow, torch.zeros_like(growth), successful)
    new_hyst = torch.where(found <= 0, torch.full_like(hyst, hysteresis), hyst_after)

    current_scale.copy_(torch.where(tolerated, scale, new_scale).reshape(current_scale.shape))
    growth_tracker.copy_(
        torch.where(tolerated, torch.zeros_like(growth), new_growth).reshape(growth_tracker.shape)
    )
    hysteresis_tracker.copy_(
        torch.where(tolerated, hyst_after, new_hyst).reshape(hysteresis_tracker.shape)
    )
    return current_scale
