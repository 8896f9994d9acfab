"""``FP16_Optimizer``: Apex's cut-down ``apex.optimizers.FP16_Optimizer``, for FusedAdam only.

Every param group of the wrapped :class:`~amp_optimizers.FusedAdam` becomes one flat half
buffer (the model's params are views into it) with one flat float32 master held by FusedAdam
(its fused master-weight path). A step flattens the half gradients of each group and hands them
to :meth:`FusedAdam.amp_fused_master_step`, which unscales them, checks them for inf/nan, steps
the master and writes the half buffer in one pass, and skips the whole step on the device on
overflow. The loss scale is amp-core's :class:`~amp_core.LossScaler` with this class's Apex
defaults; the host reads the overflow flag and the new scale once per step, to log and to keep
Apex's host counters.

For the full ``apex.fp16_utils.FP16_Optimizer`` (any optimizer, fp32 params, closures) use
``amp_legacy_fp16.FP16_Optimizer``; for new code, ``amp_core.amp.initialize(..., "O2")``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_core import (
    LossScaler,
    ScalerConfig,
    check_scale,
    fused_master_step,
    read_overflow,
)
from amp_fused_ops import flatten, unflatten

from ._fp16_optimizer_checks import check_param_groups, check_saved_state
from ._fused_adam import FusedAdam

__all__ = ["FP16_Optimizer"]

logger = logging.getLogger(__name__)

# Apex's dynamic scaling for this class (apex/optimizers/fp16_optimizer.py) is amp-core's
# "fused_fp16_optimizer" preset: start at 2**16, halve on overflow (never below 1), double after
# 1000 steps without one, no ceiling.
_PRESET = "fused_fp16_optimizer"
_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window")


class FP16_Optimizer:
    """Master weights and loss scaling for a half model trained with :class:`FusedAdam`.

    Drop-in for Apex's cut-down ``FP16_Optimizer`` (``apex.optimizers.FP16_Optimizer``, later
    ``apex.contrib.optimizers.FP16_Optimizer``), for fp16 and bf16 models, on CPU and CUDA.
    Build the model in half precision, build a :class:`FusedAdam` on its params, wrap it before
    the first step, and call ``optimizer.backward(loss)`` instead of ``loss.backward()``.

    Each param group becomes one flat half buffer, the model's params views into it, with one
    flat float32 master (:attr:`fp32_groups_flat`). A step is skipped (params, masters and
    FusedAdam's state untouched) when a gradient holds an inf or a nan, with any loss scale;
    a dynamic scale is then halved.

    Args:
        init_optimizer: The :class:`FusedAdam` to wrap, not stepped yet; every param fp16 or
            bf16 (one dtype and device per group), every param requiring grad.
        static_loss_scale: The constant loss scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: Scale dynamically: start at ``2**16``, halve on overflow (not below
            1), double after 1000 steps without overflow (Apex's values for this class).
        dynamic_loss_args: Overrides of ``init_scale``, ``scale_factor`` and ``scale_window``
            for the dynamic scale (Apex refused any).
        verbose: Log the dynamic scale's overflow messages (overflows under a static scale are
            always logged, as in Apex).

    Raises:
        TypeError: ``init_optimizer`` is not a :class:`FusedAdam`, or a param is not fp16/bf16.
        ValueError: The optimizer has state already, a group is empty or mixes dtypes or
            devices, a param does not require grad, the static scale is not a positive number,
            or ``dynamic_loss_args`` has an unknown key or a bad value.

    Example:
        >>> model = torch.nn.Linear(4, 4).half()
        >>> optimizer = FP16_Optimizer(FusedAdam(model.parameters()), dynamic_loss_scale=True)
        >>> loss = model(torch.randn(2, 4, dtype=torch.half)).float().sum()
        >>> optimizer.backward(loss)
        >>> optimizer.step()

    .. note:: Wrapping moves every param into its group's flat buffer (``param.data`` becomes
        a view): move and cast the model before wrapping, not after. A move or cast afterwards
        (``model.to(...)``, ``.half()``, ``.float()``, ``.cuda()``: anything that gives a param
        new data, even back to the same dtype) cuts the model off from the flat buffers;
        :meth:`step` and :meth:`load_state_dict` then raise ``RuntimeError``.
    """

    def __init__(
        self,
        init_optimizer: FusedAdam,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if not isinstance(init_optimizer, FusedAdam):
            raise TypeError(
                f"FP16_Optimizer only wraps amp_optimizers.FusedAdam, got "
                f"{type(init_optimizer).__name__}. Build FusedAdam(model.parameters(), ...), or "
                "use amp_legacy_fp16.FP16_Optimizer for other optimizers."
            )
        if len(init_optimizer.state) > 0:
            raise ValueError(
                "FP16_Optimizer: the FusedAdam already has state (it was stepped, loaded, or "
                "handed to amp.initialize); wrap a newly built FusedAdam before its first step."
            )
        check_param_groups(init_optimizer.param_groups)
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            args = _dynamic_args(dynamic_loss_args)
            self._scaler = _dynamic_scaler(
                args["init_scale"], args["scale_factor"], args["scale_window"]
            )
            self.scale_factor = self._scaler.scale_factor
            self.scale_window = self._scaler.scale_window
            self.last_overflow_iter = -1
        else:
            if dynamic_loss_args is not None:
                raise ValueError(
                    "FP16_Optimizer: dynamic_loss_args is given but dynamic_loss_scale is False; "
                    "pass dynamic_loss_scale=True to use it, or drop dynamic_loss_args."
                )
            self._scaler = _static_scaler(static_loss_scale)
        self.cur_iter = 0
        self._cur_scale = self._scaler.loss_scale()  # host copy, refreshed by every step

        self.fp16_groups: list[list[Tensor]] = []
        self.fp16_groups_flat: list[Tensor] = []
        with torch.no_grad():
            for group in init_optimizer.param_groups:
                params = list(group["params"])
                flat = flatten([p.detach() for p in params])
                for p, view in zip(params, unflatten(flat, params), strict=True):
                    p.data = view  # the model's param now lives in the flat buffer
                group["params"] = [flat]
                self.fp16_groups.append(params)
                self.fp16_groups_flat.append(flat)
        # Where each param's data lives in its flat buffer: a cast or a move of the model
        # (model.to(...), .half(), .float(), .cuda()) gives a param new data elsewhere, which
        # the steps would never reach (see _check_params_in_flat).
        self._param_ptrs: list[list[int]] = [[p.data_ptr() for p in g] for g in self.fp16_groups]
        # FusedAdam's fused master-weight path: it keeps one float32 master per flat buffer.
        pairs = init_optimizer.amp_enable_fused_master_weights({})
        masters = {id(flat): master for flat, master in pairs}
        self.fp32_groups_flat: list[Tensor] = [masters[id(f)] for f in self.fp16_groups_flat]
        self._device = self.fp16_groups_flat[0].device

    # -- properties ---------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host copy: no sync); assign to set it."""
        return self._cur_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        scale = check_scale(value, "FP16_Optimizer: a loss scale")  # 0, <0, inf, nan refused
        self._cur_scale = self._load_scale(scale)

    @property
    def cur_scale(self) -> float:
        """Apex's name for :attr:`loss_scale`."""
        return self.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.loss_scale = value

    @property
    def state(self) -> Any:
        """The wrapped FusedAdam's ``state`` (keyed by the flat half buffers)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped FusedAdam's ``param_groups`` (set ``lr`` here to change it)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    # -- gradients ----------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None: bool = True) -> None:
        """Drop (default) or zero the model params' gradients.

        Args:
            set_grads_to_None: Set ``.grad`` to None instead of zeroing it.
        """
        for group in self.fp16_groups:
            for p in group:
                if p.grad is None:
                    continue
                if set_grads_to_None:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: Tensor) -> None:
        """Backward of ``loss * loss_scale``, computed in float32.

        Args:
            loss: The loss (any float dtype).
        """
        scale = self._scaler.scale_tensor(self._device).to(loss.device)
        (loss.float() * scale).backward()

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every group whose params have gradients, or skip the step on overflow.

        A param without a gradient in a group that has some counts as a zero gradient (its
        slice of the flat buffer is stepped with the others).

        Args:
            closure: Optional; called (with grad enabled) first, it must compute the loss and
                call :meth:`backward`. Apex ignored it.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: The model's params were moved or cast (their data re-allocated) after
                this optimizer was built: the step would update only its flat buffers.

        .. note:: Reads the overflow flag and the new scale back to the host once (one sync).
        """
        self._check_params_in_flat("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = False
        for params, flat in zip(self.fp16_groups, self.fp16_groups_flat, strict=True):
            if all(p.grad is None for p in params):
                flat.grad = None
                continue
            flat.grad = flatten([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
            stepped = True
        if not stepped:
            return loss
        try:
            # Unscales, checks, steps the masters and writes the flat half buffers, or skips on
            # the device (and raises found_inf) when a gradient is not finite; updates the scale.
            found_inf, _ = fused_master_step(self.optimizer, self._scaler, self._device)
        finally:
            for flat in self.fp16_groups_flat:
                flat.grad = None
        overflow, (new_scale,) = read_overflow(found_inf, [self._scaler])  # the one host sync
        self._after_step(overflow, new_scale)
        return loss

    def _check_params_in_flat(self, call: str) -> None:
        """Refuse to go on when a param's data is no longer its view of the flat buffer.

        Only the flat buffers are stepped and written; ``module._apply`` (``model.to(...)``,
        ``.half()``, ``.float()``, ``.bfloat16()``, ``.cuda()``) gives a param new data when it
        casts or moves it, even back to the same dtype, and the model would then never change.
        One host-side pointer comparison per param (no device work, no sync).
        """
        for g, (params, ptrs, flat) in enumerate(
            zip(self.fp16_groups, self._param_ptrs, self.fp16_groups_flat, strict=True)
        ):
            for i, (p, ptr) in enumerate(zip(params, ptrs, strict=True)):
                if p.data_ptr() == ptr and p.dtype == flat.dtype and p.device == flat.device:
                    continue
                raise RuntimeError(
                    f"FP16_Optimizer.{call}: param {i} of group {g} (shape {tuple(p.shape)}, "
                    f"now {p.dtype} on {p.device}) no longer lives in the optimizer's flat "
                    f"{flat.dtype} buffer on {flat.device}: the model's params were moved or "
                    "cast (model.to(...), .half(), .float(), .bfloat16(), .cuda() or another "
                    "module._apply re-allocates param.data, even back to the same dtype) after "
                    "FP16_Optimizer was built, so its steps would update the flat buffer and "
                    "never the model. Move and cast the model first, then build the FusedAdam "
                    "and the FP16_Optimizer on its params."
                )

    def _after_step(self, overflow: bool, new_scale: float) -> None:
        if overflow:
            if not self.dynamic_loss_scale:
                logger.warning(
                    "Gradient overflow. Skipping step, keeping the static loss scale of %s "
                    "(iteration %d)",
                    new_scale,
                    self.cur_iter,
                )
            else:
                if self.verbose:
                    logger.warning(
                        "Gradient overflow. Skipping step, reducing loss scale to %s "
                        "(iteration %d)",
                        new_scale,
                        self.cur_iter,
                    )
                self.last_overflow_iter = self.cur_iter
        self._cur_scale = new_scale
        self.cur_iter += 1

    def _load_scale(self, scale: float) -> float:
        """Set the scaler's scale (a dynamic one brought within its bounds); return it."""
        state = {"loss_scale": scale, "unskipped": self._unskipped()}
        scale, unskipped = self._scaler.check_state_dict(state, "FP16_Optimizer.loss_scale")
        self._scaler.load_checked(scale, unskipped)
        return scale

    def _unskipped(self) -> int:
        """Steps since the last overflow or growth, from Apex's host counters (no sync)."""
        if not self.dynamic_loss_scale:
            return self.cur_iter
        return (self.cur_iter - self.last_overflow_iter - 1) % self.scale_window

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise, under Apex's keys.

        The scaler's state, FusedAdam's ``state_dict()`` (its state holds the masters) and the
        flat float32 masters (``"fp32_groups_flat"``). Tensors are references, as in torch's
        ``Optimizer.state_dict``: serialize or copy them before training on. Save the model's
        ``state_dict()`` beside it.

        Returns:
            A dict of plain data and tensors.
        """
        state: dict[str, Any] = {
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "cur_scale": self._cur_scale,
            "cur_iter": self.cur_iter,
        }
        if self.dynamic_loss_scale:
            state["last_overflow_iter"] = self.last_overflow_iter
            state["scale_factor"] = self.scale_factor
            state["scale_window"] = self.scale_window
        state["optimizer_state_dict"] = self.optimizer.state_dict()
        state["fp32_groups_flat"] = list(self.fp32_groups_flat)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this optimizer, built as the one that saved it.

        The masters are restored exactly and the model's half params are written from them,
        so training resumes bitwise (loading the model's own state as well does no harm).
        Every field is checked before anything is loaded: on an error this optimizer is left
        as it was.

        Args:
            state_dict: A dict returned by :meth:`state_dict`.

        Raises:
            TypeError: A field has the wrong type (a flag that is not a bool, a scale that is
                not a number, a counter that is not an int, masters that are not float32
                tensors).
            ValueError: A key is missing or unknown, a field has an impossible value (a loss
                scale of 0, negative, inf or nan, or below 1 for a dynamic scale; a negative
                counter; non-finite masters), or the saved masters do not match this
                optimizer's groups.
            RuntimeError: The model's params were moved or cast after this optimizer was
                built (the loaded weights would not reach the model).
        """
        self._check_params_in_flat("load_state_dict")
        checked = check_saved_state(state_dict, [m.numel() for m in self.fp32_groups_flat])
        if checked["dynamic"]:
            scaler = _dynamic_scaler(
                checked["cur_scale"], checked["scale_factor"], checked["scale_window"]
            )
        else:
            scaler = _static_scaler(checked["cur_scale"])
        # Everything is valid. FusedAdam checks its own state first (and raises before
        # changing anything); then nothing can fail.
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.dynamic_loss_scale = checked["dynamic"]
        self.cur_iter = checked["cur_iter"]
        if self.dynamic_loss_scale:
            self.last_overflow_iter = checked["last_overflow_iter"]
            self.scale_factor = checked["scale_factor"]
            self.scale_window = checked["scale_window"]
        self._scaler = scaler
        cur_scale = checked["cur_scale"]
        self._cur_scale = self._load_scale(cur_scale)
        with torch.no_grad():
            for master, flat, value in zip(
                self.fp32_groups_flat, self.fp16_groups_flat, checked["masters"], strict=True
            ):
                master.copy_(value)
                flat.copy_(master)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        params = sum(len(g) for g in self.fp16_groups)
        return (
            f"FP16_Optimizer(FusedAdam, {kind} loss scale {self._cur_scale}, "
            f"{len(self.fp16_groups)} flat group(s), {params} params)"
        )


def _dynamic_args(dynamic_loss_args: dict[str, Any] | None) -> dict[str, Any]:
    given = dict(dynamic_loss_args or {})
    unknown = sorted(set(given) - set(_DYNAMIC_ARGS))
    if unknown:
        raise ValueError(
            f"FP16_Optimizer: dynamic_loss_args has unknown key(s) {unknown}; the keys are "
            f"{sorted(_DYNAMIC_ARGS)}, e.g. dynamic_loss_args={{'scale_window': 500}}."
        )
    preset = ScalerConfig.preset(_PRESET)
    return {name: given.get(name, getattr(preset, name)) for name in _DYNAMIC_ARGS}


def _dynamic_scaler(init_scale: Any, scale_factor: Any, scale_window: Any) -> LossScaler:
    if not isinstance(init_scale, (int, float)) or not math.isfinite(init_scale) or init_scale < 1:
        raise ValueError(f"FP16_Optimizer: init_scale must be a number >= 1, got {init_scale!r}")
    if isinstance(scale_window, bool) or not isinstance(scale_window, int):
        raise ValueError(f"FP16_Optimizer: scale_window must be an int >= 1, got {scale_window!r}")
    try:
        config = ScalerConfig.preset(
            _PRESET, init_scale=init_scale, scale_factor=scale_factor, scale_window=scale_window
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"FP16_Optimizer: {err}") from None
    return LossScaler.from_config(config)


def _static_scaler(scale: float) -> LossScaler:
    try:
        value = check_scale(scale, "static_loss_scale")
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"FP16_Optimizer: static_loss_scale must be a positive number, got {scale!r} ({err})"
        ) from None
    return LossScaler.from_config(ScalerConfig(loss_scale=value))
