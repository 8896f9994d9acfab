"""Opt levels O0-O3 as data, and the validation of user overrides.

The preset table and the refusals follow Apex's Amp 1.0 (``apex/amp/frontend.py``): an
override is applied on top of the preset for the chosen level, and overrides that make no
sense for that level raise with Apex's explanation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

from ._scaler_config import ScalerConfig

__all__ = ["DYNAMIC", "LossScaleSpec", "OptLevel", "Properties", "resolve_properties"]

DYNAMIC: Literal["dynamic"] = "dynamic"
LossScaleSpec = Union[float, Literal["dynamic"]]  # noqa: UP007 (a runtime alias on 3.10)

# Sentinel dtype in the presets: "the low-precision dtype chosen for this run".
_HALF = "half"

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class OptLevel(str, enum.Enum):
    """Apex's optimization levels.

    O0 is pure fp32; O1 casts individual ops; O2 casts the model ("almost half") and keeps
    fp32 master weights; O3 is pure half.
    """

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"

    @classmethod
    def parse(cls, value: str | OptLevel) -> OptLevel:
        if isinstance(value, OptLevel):
            return value
        try:
            return cls(value)
        except ValueError:
            hint = ""
            if isinstance(value, str) and value[:1] == "0":
                hint = (
                    " Note that in `O0`, `O1`, etc., the prefix O is the letter O, "
                    "not the number zero."
                )
            raise RuntimeError(
                f"Unexpected optimization level {value!r}. Options are 'O0', 'O1', 'O2', 'O3'."
                + hint
            ) from None


@dataclass(frozen=True)
class Properties:
    """The resolved options of one ``amp.initialize`` call.

    Attributes:
        enabled: ``False`` makes every amp call a no-op.
        opt_level: The level the presets came from.
        half_dtype: The low-precision dtype (``torch.float16`` or ``torch.bfloat16``).
        cast_model_type: dtype the model is cast to (O2/O3), ``torch.float32`` (O0), or
            ``None`` / ``False``: the model keeps the dtypes it arrived with (``None`` is O1's
            preset, ``False`` is Apex's override for "do not cast"; see :attr:`model_cast`).
        patch_torch_functions: Whether ops are cast per Apex's O1 policy.
        keep_batchnorm_fp32: Whether batchnorm stays fp32 when the model is cast.
        master_weights: Whether the optimizer steps fp32 master copies of half params.
        loss_scale: A static scale, or ``"dynamic"``.
        cast_model_outputs: dtype model outputs are cast to, or ``None``.
        min_loss_scale: Floor of the dynamic scale, or ``None``.
        max_loss_scale: Ceiling of the dynamic scale.
    """

    enabled: bool
    opt_level: OptLevel
    half_dtype: torch.dtype
    cast_model_type: torch.dtype | Literal[False] | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: LossScaleSpec
    cast_model_outputs: torch.dtype | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24

    def __post_init__(self) -> None:
        # Checked here, so that no Properties with an impossible value can exist.
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(self.enabled).__name__}.")
        if not isinstance(self.opt_level, OptLevel):
            raise TypeError(f"opt_level must be an OptLevel, got {self.opt_level!r}.")
        _check_half_dtype("half_dtype", self.half_dtype)
        _check_cast_model_type(self.cast_model_type)
        for name in ("patch_torch_functions", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if self.keep_batchnorm_fp32 is not None and not isinstance(self.keep_batchnorm_fp32, bool):
            raise TypeError(
                f"keep_batchnorm_fp32 must be a bool or None, got {self.keep_batchnorm_fp32!r}."
            )
        object.__setattr__(self, "loss_scale", _parse_loss_scale(self.loss_scale))
        outputs = self.cast_model_outputs
        if outputs is not None and not (
            isinstance(outputs, torch.dtype) and outputs.is_floating_point
        ):
            raise TypeError(f"cast_model_outputs must be a floating torch.dtype, got {outputs!r}.")
        config = self.scaler_config()  # checks min_loss_scale and max_loss_scale
        object.__setattr__(self, "min_loss_scale", config.min_loss_scale)
        object.__setattr__(self, "max_loss_scale", config.max_loss_scale)

    @property
    def model_cast(self) -> torch.dtype | None:
        """The dtype ``amp.initialize`` casts the models to, or ``None`` when it leaves their
        dtypes alone (``cast_model_type`` ``None`` or ``False``): then it does not cast their
        inputs or (unless ``cast_model_outputs``) outputs, and their ``state_dict()`` holds
        their own tensors, as Apex's ``if properties.cast_model_type:``."""
        return self.cast_model_type if self.cast_model_type is not False else None

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == DYNAMIC

    def scaler_config(self) -> ScalerConfig:
        """The settings of this call's loss scalers: Apex amp's preset with these bounds."""
        return ScalerConfig.preset(
            "amp",
            loss_scale=self.loss_scale,
            min_loss_scale=self.min_loss_scale,
            max_loss_scale=self.max_loss_scale,
        )

    def describe(self) -> dict[str, Any]:
        """The options in Apex's printed order, for logging."""
        return {
            "enabled": self.enabled,
            "opt_level": self.opt_level.value,
            "cast_model_type": self.cast_model_type,
            "patch_torch_functions": self.patch_torch_functions,
            "keep_batchnorm_fp32": self.keep_batchnorm_fp32,
            "master_weights": self.master_weights,
            "loss_scale": self.loss_scale,
        }


# Apex's documented table; ``_HALF`` stands for the run's low-precision dtype.
_PRESETS: dict[OptLevel, dict[str, Any]] = {
    OptLevel.O0: {
        "cast_model_type": torch.float32,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": None,
        "master_weights": False,
        "loss_scale": 1.0,
    },
    OptLevel.O1: {
        "cast_model_type": None,
        "patch_torch_functions": True,
        "keep_batchnorm_fp32": None,
        "master_weights": None,
        "loss_scale": DYNAMIC,
    },
    OptLevel.O2: {
        "cast_model_type": _HALF,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": True,
        "master_weights": True,
        "loss_scale": DYNAMIC,
    },
    OptLevel.O3: {
        "cast_model_type": _HALF,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": False,
        "master_weights": False,
        "loss_scale": 1.0,
    },
}


def _parse_bool(name: str, value: Any) -> bool | None:
    # Apex accepted the strings "True"/"False" (handy from argparse).
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        raise ValueError(f"{name} must be True, False or None, got the string {value!r}.")
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}.")


def _parse_loss_scale(value: Any) -> LossScaleSpec:
    if value == DYNAMIC:
        return DYNAMIC
    if isinstance(value, bool):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}.")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"loss_scale must be 'dynamic' or a positive number, got {value!r}."
        ) from None
    if not 0.0 < scale <= torch.finfo(torch.float32).max:  # the scale is an fp32 tensor
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}.")
    return scale


def _check_cast_model_type(value: Any) -> None:
    # ``is`` for False: 0 and 0.0 compare equal to it.
    if value is None or value is False or value is torch.float32 or value in _HALF_DTYPES:
        return
    raise ValueError(
        f"cast_model_type must be torch.float16, torch.bfloat16, torch.float32, or False (do "
        f"not cast the model), got {value!r}."
    )


def _check_half_dtype(name: str, dtype: Any) -> torch.dtype:
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"{name} must be torch.float16 or torch.bfloat16, got {dtype!r}.")
    return dtype


def resolve_properties(
    opt_level: str | OptLevel,
    *,
    enabled: bool,
    default_half_dtype: torch.dtype,
    half_dtype: torch.dtype | None,
    overrides: dict[str, Any],
    cast_model_outputs: torch.dtype | None,
    min_loss_scale: float | None,
    max_loss_scale: float,
) -> Properties:
    """Apply ``overrides`` (the non-``None`` keyword arguments of ``initialize``) to a preset.

    Raises:
        RuntimeError: for an unknown level or an override Apex refuses for that level.
        ValueError: for a malformed value.
    """
    level = OptLevel.parse(opt_level)
    values = dict(_PRESETS[level])

    if half_dtype is not None:
        _check_half_dtype("half_dtype", half_dtype)

    for name, value in overrides.items():
        if name == "cast_model_type":
            # False ("do not cast the model") is accepted at every level, O1 included, as by
            # Apex's Properties; Apex's multi-model tests pass it for half models.
            if level is OptLevel.O1 and value is not torch.float32 and value is not False:
                raise RuntimeError(
                    "O1 inserts casts around Torch functions rather than model weights, so "
                    "with O1, the model weights themselves should remain FP32. If you wish "
                    "to cast the model to a different type, use opt_level='O2' or 'O3'. "
                    f"cast_model_type was {value}"
                )
            _check_cast_model_type(value)
            values[name] = value
        elif name == "patch_torch_functions":
            flag = _parse_bool(name, value)
            if level is not OptLevel.O1 and flag:
                raise RuntimeError(
                    "Currently, patch_torch_functions=True should only be set by selecting "
                    "opt_level='O1'."
                )
            values[name] = flag
        elif name == "keep_batchnorm_fp32":
            flag = _parse_bool(name, value)
            if level is OptLevel.O1:
                raise RuntimeError(
                    "With opt_level O1, batchnorm functions are automatically patched to run "
                    "in FP32, so keep_batchnorm_fp32 should be None. "
                    f"keep_batchnorm_fp32 was {value}"
                )
            values[name] = flag
        elif name == "master_weights":
            flag = _parse_bool(name, value)
            if level is OptLevel.O1:
                raise RuntimeError(
                    "It doesn't make sense to use master_weights with O1. With O1, your model "
                    "weights themselves should be FP32."
                )
            values[name] = flag
        elif name == "loss_scale":
            values[name] = _parse_loss_scale(value)
        else:  # pragma: no cover - initialize only passes the names above
            raise AssertionError(name)

    # The run's half dtype: explicit half_dtype, else a half cast_model_type, else the device
    # default. The two explicit ways must agree.
    cast = values["cast_model_type"]
    if half_dtype is not None and cast in _HALF_DTYPES and cast is not half_dtype:
        raise ValueError(
            f"half_dtype={half_dtype} conflicts with cast_model_type={cast}; pass one of them."
        )
    chosen = half_dtype if half_dtype is not None else cast if cast in _HALF_DTYPES else None
    resolved_half = chosen if chosen is not None else default_half_dtype
    if cast == _HALF:
        cast = resolved_half

    # The opt level's scale whatever the half dtype: O1 and O2 scale dynamically for bf16 too.
    # bf16 needs no scale against underflow (it has fp32's exponent range), but the dynamic
    # scaler is also what skips a step with an inf or nan gradient, and multiplying by a power
    # of two costs bf16 no precision.
    loss_scale = values["loss_scale"]

    # Properties checks the rest (cast_model_outputs, min_loss_scale, max_loss_scale).
    return Properties(
        enabled=enabled,
        opt_level=level,
        half_dtype=resolved_half,
        cast_model_type=cast,
        patch_torch_functions=bool(values["patch_torch_functions"]),
        keep_batchnorm_fp32=values["keep_batchnorm_fp32"],
        master_weights=bool(values["master_weights"]),
        loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )
