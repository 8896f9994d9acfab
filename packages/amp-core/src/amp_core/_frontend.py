"""``amp.initialize``: resolve the options, then prepare the models and optimizers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from ._apex_state import apex_state
from ._casting import O1Casting
from ._fused_master import check_amp_initialize
from ._messages import show_setup
from ._model import ModelAmpState, model_state
from ._opt_levels import OptLevel, Properties, resolve_properties
from ._optimizer import OptimizerAmpState, optimizer_state
from ._scaler import LossScaler
from ._sharded import refuse_sharded_cast
from ._state import AmpSession, registry

__all__ = ["initialize"]

logger = logging.getLogger("amp_core")


def _as_list(value: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    def accepted(v: Any) -> bool:
        return isinstance(v, kind) or (kind is torch.optim.Optimizer and _is_wrapper(v))

    if accepted(value):
        return [value], False
    if isinstance(value, (list, tuple)) and all(accepted(v) for v in value):
        return list(value), True
    raise TypeError(
        f"{what} must be either a single {kind.__name__} or a list of them, got {value!r}."
    )


def _is_wrapper(value: Any) -> bool:
    """An optimizer wrapper such as ``LARC``: it holds a torch optimizer as ``.optim`` and
    exposes its ``param_groups``, ``state``, ``step`` and ``zero_grad`` (Apex accepted LARC)."""
    return (
        isinstance(getattr(value, "optim", None), torch.optim.Optimizer)
        and hasattr(value, "param_groups")
        and callable(getattr(value, "step", None))
        and callable(getattr(value, "zero_grad", None))
    )


def _default_half_dtype(models: Sequence[nn.Module]) -> torch.dtype:
    for model in models:
        for p in model.parameters():
            return torch.float16 if p.device.type == "cuda" else torch.bfloat16
    return torch.float16 if torch.cuda.is_available() else torch.bfloat16


def _device_types(models: Sequence[nn.Module]) -> list[str]:
    found = {p.device.type for m in models for p in m.parameters()}
    found |= {b.device.type for m in models for b in m.buffers()}
    if not found:
        found = {"cuda" if torch.cuda.is_available() else "cpu"}
    unsupported = found - {"cpu", "cuda"}
    if unsupported:
        raise RuntimeError(
            f"amp supports models on CPU and CUDA; found parameters on {sorted(unsupported)}."
        )
    return sorted(found)


def _check_inputs(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    for model in models:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model).__name__}. Parallel wrappers "
                "should only be applied to the model(s) AFTER the model(s) have been returned "
                "from amp.initialize."
            )
        state = model_state(model)
        if state is not None and state.is_cast:
            raise RuntimeError(
                f"The model {type(model).__name__} was already returned by amp.initialize "
                "(its weights and forward are amp-cast). Pass a freshly built model."
            )
    seen: set[int] = set()
    for optimizer in optimizers:
        if optimizer_state(optimizer) is not None:
            raise RuntimeError(
                f"This {type(optimizer).__name__} was already passed to amp.initialize. "
                "An optimizer can be initialized once; to start over, build a new optimizer "
                "(and model) and pass those, or call amp.close() first."
            )
        if id(optimizer) in seen:
            raise RuntimeError(
                f"The same {type(optimizer).__name__} appears twice in the optimizers passed "
                "to amp.initialize."
            )
        seen.add(id(optimizer))


def _check_optimizers(optimizers: Sequence[Any], props: Properties) -> None:
    """Ask each optimizer that can refuse this call (``amp_check_initialize``, see
    :func:`~amp_core._fused_master.check_amp_initialize`) whether it accepts it, before
    anything is changed."""
    for optimizer in optimizers:
        check_amp_initialize(optimizer, master_weights=props.master_weights, cast=props.model_cast)


def _warn_if_not_fp32(models: Sequence[nn.Module]) -> None:
    for model in models:
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32:
                logger.warning(
                    "Found param %s with type %s, expected torch.float32. When using "
                    "amp.initialize, you do not need to call .half() on your model before "
                    "passing it, no matter what optimization level you choose (the fp32 "
                    "master weights are then made from the rounded values).",
                    name,
                    param.dtype,
                )
                return


# What each opt level does, for the summary that verbosity=1 shows.
_BRIEFS = {
    OptLevel.O0: "pure fp32 training.",
    OptLevel.O1: "automatic casts around PyTorch functions and Tensor methods.",
    OptLevel.O2: "half-precision model with fp32 batch norm and fp32 master weights.",
    OptLevel.O3: "pure half-precision training.",
}


def _log_properties(props: Properties, overrides: dict[str, Any]) -> None:
    """Apex's verbosity=1 summary: the selected opt level and the resulting options."""
    lines = [f"Selected optimization level {props.opt_level.value}: {_BRIEFS[props.opt_level]}"]
    if overrides:
        lines.append(f"User overrides (keyword arguments that are not None): {overrides}")
    lines.append("Optimization options:")
    options = {**props.describe(), "half_dtype": props.half_dtype}
    lines.extend(f"{name:22} : {value}" for name, value in options.items())
    lines.append("(verbosity=0 or logging configuration for 'amp_core' hides this summary)")
    show_setup(logger, "\n".join(lines))


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | Literal[False] | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    half_dtype: torch.dtype | None = None,
) -> Any:
    """Prepare models and optimizers for mixed precision, as Apex's ``amp.initialize``.

    Call it once, after the model is on its device and the optimizer is built, and before any
    parallel wrapper (DistributedDataParallel). The opt level picks a preset; any non-``None``
    keyword below overrides it.

    ======  ================  =================  ===================  ==============  ==========
    level   cast_model_type   patch_torch_funcs  keep_batchnorm_fp32  master_weights  loss_scale
    ======  ================  =================  ===================  ==============  ==========
    O0      torch.float32     False              None                 False           1.0
    O1      None              True               None                 None            "dynamic"
    O2      half dtype        False              True                 True            "dynamic"
    O3      half dtype        False              False                False           1.0
    ======  ================  =================  ===================  ==============  ==========

    Args:
        models: A model or a list of models.
        optimizers: An optimizer, a list of optimizers, or ``None``. An optimizer wrapped in
            ``amp_parallel.LARC`` (or any wrapper holding it as ``.optim``) is accepted.
        enabled: ``False`` returns the inputs untouched and makes every amp call a no-op.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        cast_model_type: dtype the model is cast to (O2/O3): ``torch.float16`` or
            ``torch.bfloat16``; or ``False`` (any level, as in Apex): do not cast the models,
            whose params and buffers keep the dtypes they arrived in (see docs/opt_levels.rst,
            "Models that arrive in half precision").
        patch_torch_functions: Cast ops per Apex's policy (O1 only).
        keep_batchnorm_fp32: Keep batchnorm in fp32 when the model is cast.
        master_weights: Step fp32 master copies of half params (O2/O3).
        loss_scale: A static scale, or ``"dynamic"``.
        cast_model_outputs: dtype the model's floating outputs are cast to.
        num_losses: How many losses get their own scaler (``loss_id`` in ``scale_loss``).
        verbosity: 0 logs nothing; 1 logs the selected opt level and options (INFO, on
            rank 0; printed to stderr when the application has not configured logging,
            as Apex printed it) and skipped steps (WARNING).
        min_loss_scale: Floor of the dynamic scale.
        max_loss_scale: Ceiling of the dynamic scale.
        half_dtype: The low-precision dtype, at any level. Defaults to ``torch.float16`` for a
            model on CUDA and ``torch.bfloat16`` on CPU. bf16 runs default to no loss scaling
            (bf16 has fp32's exponent range); pass ``loss_scale`` to scale anyway.

    Returns:
        The models and optimizers in the form they were given: ``model`` or ``[models]`` alone
        when ``optimizers`` is ``None``, else ``(models, optimizers)``.

    Every refusal comes before the first change: after an error the models, the optimizers and
    the previous call are as they were, and a call with fixed arguments works.

    Raises:
        RuntimeError: for an unknown opt level, an override Apex refuses for that level, a
            wrapped (DDP) model, or an optimizer that was initialized before.
        TypeError: when models / optimizers are not modules / optimizers.
        ValueError: for a malformed value, or an optimizer that cannot step what the level
            makes (its ``amp_check_initialize`` refuses: a stochastically rounding FusedAdam or
            FusedSGD at O2, or cast to a dtype other than bfloat16).

    Example:
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    model_list, models_was_list = _as_list(models, nn.Module, "models")
    optimizer_list: list[torch.optim.Optimizer] = []
    optimizers_was_list = False
    if optimizers is None:
        pass
    else:
        optimizer_list, optimizers_was_list = _as_list(
            optimizers, torch.optim.Optimizer, "optimizers"
        )
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int, got {num_losses!r}.")

    overrides = {
        name: value
        for name, value in (
            ("cast_model_type", cast_model_type),
            ("patch_torch_functions", patch_torch_functions),
            ("keep_batchnorm_fp32", keep_batchnorm_fp32),
            ("master_weights", master_weights),
            ("loss_scale", loss_scale),
        )
        if value is not None
    }
    props = resolve_properties(
        opt_level,
        enabled=bool(enabled),
        default_half_dtype=_default_half_dtype(model_list),
        half_dtype=half_dtype,
        overrides=overrides,
        cast_model_outputs=cast_model_outputs,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )

    def result() -> Any:
        out_models = model_list if models_was_list else model_list[0]
        if optimizers is None:
            return out_models
        return out_models, optimizer_list if optimizers_was_list else optimizer_list[0]

    if not props.enabled:
        registry.replace(AmpSession(props, verbosity=verbosity))
        return result()

    # Every refusal comes before the first change: a refused call leaves the models, the
    # optimizers and the previous call's session as they were, and a retry with fixed
    # arguments works.
    _check_inputs(model_list, optimizer_list)
    model_cast = props.model_cast
    if props.master_weights or model_cast not in (None, torch.float32):
        refuse_sharded_cast(model_list, props.opt_level.value, model_cast)
    device_types = _device_types(model_list)
    _check_optimizers(optimizer_list, props)

    session = AmpSession(props, verbosity=verbosity)
    registry.replace(session)  # switches off the previous session's O1 casting

    if verbosity > 0:
        _log_properties(props, overrides)

    # Models: plan the cast, remember full-precision values for the masters, then cast.
    output_dtype = props.cast_model_outputs
    if model_cast is not None and output_dtype is None:
        output_dtype = torch.float32
    model_states = []
    fp32_sources: dict[nn.Parameter, torch.Tensor] = {}
    if model_cast is not None and verbosity > 0 and not apex_state.allow_incoming_model_not_fp32:
        _warn_if_not_fp32(model_list)
    for model in model_list:
        previous = model_state(model)
        if previous is not None:  # an O1 model initialized again: drop its old hooks
            previous.remove()
        state = ModelAmpState(
            model,
            model_cast,
            props.keep_batchnorm_fp32,
            output_dtype,
            fresh_cast_cache=props.patch_torch_functions,
        )
        if props.master_weights:
            for _, module, name, is_param in state.plan:
                if is_param:
                    param = getattr(module, name)
                    fp32_sources[param] = param.detach()
        state.apply()
        model._amp_state = state
        model_states.append(state)

    optimizer_states = []
    for optimizer in optimizer_list:
        opt_state = OptimizerAmpState(
            optimizer, session, props.master_weights, fp32_sources, model_states
        )
        optimizer_states.append(opt_state)
        optimizer._amp_state = opt_state  # type: ignore[attr-defined]
        for state in model_states:
            state.attach(opt_state.weights)  # masters are looked up there, when needed
    fp32_sources.clear()

    session.scalers = [LossScaler.from_config(props.scaler_config()) for _ in range(num_losses)]
    models_and_optimizers: list[tuple[ModelAmpState | OptimizerAmpState, Any]] = [
        *zip(model_states, model_list, strict=True),
        *zip(optimizer_states, optimizer_list, strict=True),
    ]
    registry.track(models_and_optimizers)
    if props.patch_torch_functions:
        session.casting = O1Casting(
            device_types,
            props.half_dtype,
            verbose=verbosity > 0,
            owner=session,
            on_deactivate=session.casting_off,
        )
    if props.opt_level is OptLevel.O1 and not props.patch_torch_functions and verbosity > 0:
        logger.info("O1 with patch_torch_functions=False: no casting is done.")
    return result()
