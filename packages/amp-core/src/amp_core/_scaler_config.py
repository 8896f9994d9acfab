"""Loss-scaler settings as data: :class:`ScalerConfig`, validated once, and the named presets.

Apex had three dynamic loss scalers with different defaults: ``apex.amp``'s (start at 2**16,
grow after 2000 steps, at most 2**24), ``apex.fp16_utils.DynamicLossScaler`` (start at 2**32,
grow after 1000 steps, never below 1, no ceiling) and ``apex.optimizers.FP16_Optimizer``'s
(start at 2**16, grow after 1000 steps, never below 1, no ceiling). Each is one entry of
:data:`SCALER_PRESETS`; every scaler of the toolkit is built from a :class:`ScalerConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = [
    "DEFAULT_MIN_LOSS_SCALE",
    "SCALER_PRESETS",
    "ScalerConfig",
    "check_count",
    "check_scale",
]

DEFAULT_MIN_LOSS_SCALE = 2.0**-24
"""The floor of a dynamic scale when no ``min_loss_scale`` is given: the reciprocal of the
default ``max_loss_scale``. Its reciprocal (``2**24``) is exact and finite in float32."""

_FLOAT32_MAX = torch.finfo(torch.float32).max
_INT32_MAX = torch.iinfo(torch.int32).max  # the device counters are int32
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: its reciprocal is finite


def check_scale(value: Any, where: str) -> float:
    """``value`` as a loss scale: a real number, finite and > 0.

    Args:
        value: The value to check.
        where: How the error names the value (e.g. ``'state_dict["loss_scale"]'``).

    Returns:
        The scale as a float.

    Raises:
        TypeError: for a value that is not a real number (a bool, a string, a tensor...).
        ValueError: for 0, a negative number, inf or nan.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where} must be a number, positive and finite, got {type(value).__name__} {value!r}."
        )
    scale = _as_float(value)
    if not (math.isfinite(scale) and 0.0 < scale <= _FLOAT32_MAX):
        raise ValueError(
            f"{where} must be positive and finite, got {_show(value)}: a loss scale of 0, a "
            "negative one, inf, nan or one beyond float32's range would write inf or nan into "
            "the weights. Fix or drop the value (a new run starts from the default scale)."
        )
    return scale


def _as_float(value: Any) -> float:
    """``float(value)``, with an integer too large for a float as +-inf (not OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _show(value: Any) -> str:
    """``repr(value)``, shortened for an integer of hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:12]}...({len(text)} characters)"


def check_count(value: Any, where: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a step counter: an int (not a bool) ``>= minimum`` (and ``<= maximum``).

    Raises:
        TypeError: for a value that is not an int.
        ValueError: for an int below ``minimum`` or above ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an int, got {type(value).__name__} {_show(value)}.")
    count = int(value)
    if count < minimum or (maximum is not None and count > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{where} must be an int {bounds}, got {_show(value)}.")
    return count


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {_show(value)}.")
    return _as_float(value)


@dataclass(frozen=True)
class ScalerConfig:
    """The settings of one loss scaler, checked when the config is made.

    Dynamic scaling starts at ``init_scale`` (brought within ``[min_loss_scale,
    max_loss_scale]``, as Apex did), is multiplied by ``scale_factor`` after ``scale_window``
    consecutive steps without overflow and divided by it on every overflow.

    Attributes:
        loss_scale: ``"dynamic"``, or a positive finite number for a static scale (the other
            fields are then unused).
        init_scale: The first dynamic scale: positive and finite.
        scale_factor: Growth and backoff factor: finite and > 1.
        scale_window: Steps without overflow between two growths: an int >= 1 (an integral
            float such as ``1000.0`` is accepted).
        min_loss_scale: Floor of the dynamic scale, at least ``2**-126`` so that ``1/scale`` is
            finite in float32; ``None`` gives :data:`DEFAULT_MIN_LOSS_SCALE`.
        max_loss_scale: Ceiling of the dynamic scale: > 0, ``inf`` for none.

    Raises:
        TypeError: a field of the wrong type (a string for a number, a bool...).
        ValueError: a value out of its range, naming the field and the value.

    Example:
        >>> config = ScalerConfig.preset("fp16_utils", scale_window=500)
        >>> scaler = LossScaler.from_config(config)
    """

    loss_scale: float | Literal["dynamic"] = "dynamic"
    init_scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 2000
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24

    def __post_init__(self) -> None:
        fix = object.__setattr__  # normalised values on a frozen instance
        if self.loss_scale != "dynamic":
            if isinstance(self.loss_scale, str):
                raise ValueError(
                    f"loss_scale must be 'dynamic' or a positive number, got {self.loss_scale!r}."
                )
            fix(self, "loss_scale", check_scale(self.loss_scale, "A static loss_scale"))
        fix(self, "init_scale", check_scale(self.init_scale, "init_scale"))
        factor = _real(self.scale_factor, "scale_factor")
        if not (1.0 < factor < math.inf):
            raise ValueError(
                f"scale_factor must be greater than 1, got {_show(self.scale_factor)}: the "
                "scale is multiplied by it to grow and divided by it to back off, so it must "
                "be > 1 and finite (Apex uses 2.0)."
            )
        fix(self, "scale_factor", factor)
        window = _real(self.scale_window, "scale_window")
        if not (1 <= window <= _INT32_MAX and window == int(window)):
            raise ValueError(
                f"scale_window must be a positive int, got {_show(self.scale_window)} (at "
                f"most {_INT32_MAX}): the number of "
                "steps without overflow between two growths of the scale (Apex uses 2000 for "
                "amp, 1000 for fp16_utils)."
            )
        fix(self, "scale_window", int(window))
        ceiling = _real(self.max_loss_scale, "max_loss_scale")
        if not ceiling > 0:  # inf allowed: no ceiling
            raise ValueError(
                f"max_loss_scale must be positive, got {self.max_loss_scale!r}; pass "
                "float('inf') for no ceiling."
            )
        fix(self, "max_loss_scale", ceiling)
        if self.min_loss_scale is not None:
            floor = _real(self.min_loss_scale, "min_loss_scale")
            if not (_FLOAT32_TINY <= floor < math.inf):
                raise ValueError(
                    f"min_loss_scale must be at least 2**-126 (float32's smallest normal "
                    f"number, so that 1/scale is finite), got {_show(self.min_loss_scale)}; None "
                    "gives the default floor 2**-24."
                )
            if floor > ceiling:
                raise ValueError(
                    f"min_loss_scale={self.min_loss_scale} is larger than "
                    f"max_loss_scale={self.max_loss_scale}."
                )
            fix(self, "min_loss_scale", floor)

    @property
    def dynamic(self) -> bool:
        """Whether the scale is dynamic."""
        return self.loss_scale == "dynamic"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ScalerConfig:
        """The preset ``name`` of :data:`SCALER_PRESETS`, with ``overrides`` applied (and
        checked).

        Raises:
            ValueError: for an unknown preset name, or an override out of range.
            TypeError: for an unknown field name or an override of the wrong type.
        """
        try:
            base = SCALER_PRESETS[name]
        except KeyError:
            raise ValueError(
                f"Unknown loss scaler preset {name!r}; the presets are {sorted(SCALER_PRESETS)}."
            ) from None
        return dataclasses.replace(base, **overrides)


SCALER_PRESETS: Mapping[str, ScalerConfig] = MappingProxyType(
    {
        # apex.amp (amp.initialize, the pre-1.0 amp.init handle): 2**16, x2 after 2000, <= 2**24.
        "amp": ScalerConfig(),
        # apex.fp16_utils.DynamicLossScaler: 2**32, x2 after 1000, never below 1, no ceiling.
        "fp16_utils": ScalerConfig(
            init_scale=2.0**32, scale_window=1000, min_loss_scale=1.0, max_loss_scale=math.inf
        ),
        # apex.optimizers.FP16_Optimizer (for FusedAdam): 2**16, x2 after 1000, >= 1, no ceiling.
        "fused_fp16_optimizer": ScalerConfig(
            init_scale=2.0**16, scale_window=1000, min_loss_scale=1.0, max_loss_scale=math.inf
        ),
    }
)
"""The dynamic-scaler defaults of Apex's three APIs, by name: ``"amp"``, ``"fp16_utils"``,
``"fused_fp16_optimizer"``. Read-only; derive a variant with :meth:`ScalerConfig.preset`."""
