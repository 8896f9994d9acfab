"""What ``amp.initialize`` does to a model: the cast (O2/O3), input/output casting, state dicts.

Every change is made through PyTorch's module hooks and recorded on the model's
:class:`ModelAmpState` (``model._amp_state``), so :meth:`ModelAmpState.remove` undoes it.

State dicts: the model's ``state_dict()`` holds fp32 tensors for everything amp cast: the fp32
master weights where the optimizer keeps them, otherwise the cast tensor widened back. Loading a
state dict writes the master weights too, so that a resumed O2 run is bitwise identical to an
uninterrupted one, and checkpoints move freely between opt levels and plain fp32 models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

__all__ = ["ModelAmpState", "cast_floating", "model_master_weights", "plan_cast"]


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside ``value`` (tensors, lists, tuples, dicts) to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: cast_floating(v, dtype) for k, v in value.items()})  # type: ignore[call-arg]
    return value


def plan_cast(
    model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool | None
) -> list[tuple[str, nn.Module, str, bool]]:
    """The tensors the cast will change: ``(qualified name, owner module, attr, is_param)``.

    Batchnorm modules keep fp32 parameters and buffers when ``keep_batchnorm_fp32``.
    """
    plan = []
    for module_name, module in model.named_modules():
        if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
            continue
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                plan.append((prefix + name, module, name, True))
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                plan.append((prefix + name, module, name, False))
    return plan


class _CastCacheGuard:
    """Clears autocast's weight-cast cache when a weight changed in place since it was cached.

    A forward pre-hook on every module that owns parameters compares their version counters
    (bumped by ``optimizer.step()``, ``load_state_dict`` and any in-place edit) with the ones
    seen at its last call: the cache never serves a low-precision copy of an old weight, and it
    still serves repeated uses of unchanged weights.
    """

    def __init__(self) -> None:
        self._versions: dict[nn.Parameter, int] = {}

    def __call__(self, module: nn.Module, args: Any) -> None:
        versions = self._versions
        changed = False
        for param in module._parameters.values():
            if param is not None and versions.get(param) != param._version:
                versions[param] = param._version
                changed = True
        if changed:
            torch.clear_autocast_cache()


class ModelAmpState:
    """Amp's record on one model (``model._amp_state``).

    Args:
        model: The model.
        cast_model_type: dtype the model is cast to, or ``None`` for no cast (O1).
        keep_batchnorm_fp32: Whether batchnorm stays fp32 during the cast.
        output_dtype: dtype floating outputs are cast to, or ``None`` to leave them.
        fresh_cast_cache: Guard autocast's weight-cast cache (O1) so that no forward sees a
            low-precision copy of a weight changed in place since it was cached.
    """

    def __init__(
        self,
        model: nn.Module,
        cast_model_type: torch.dtype | None,
        keep_batchnorm_fp32: bool | None,
        output_dtype: torch.dtype | None,
        *,
        fresh_cast_cache: bool = False,
    ) -> None:
        self.cast_model_type = cast_model_type
        self.fresh_cast_cache = fresh_cast_cache
        self.output_dtype = output_dtype
        # qualified name -> dtype before the cast, for every tensor the cast changed
        self.original_dtypes: dict[str, torch.dtype] = {}
        self.plan = (
            plan_cast(model, cast_model_type, keep_batchnorm_fp32)
            if cast_model_type is not None
            else []
        )
        # model param -> its fp32 master (filled in by the optimizers that step the masters)
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = []
        self._model = model

    @property
    def model(self) -> nn.Module:
        """The model this record belongs to."""
        return self._model

    def apply(self) -> None:
        """Cast the planned tensors and install the hooks."""
        model, dtype = self._model, self.cast_model_type
        with torch.no_grad():
            for qualified, module, name, is_param in self.plan:
                assert dtype is not None
                tensor = getattr(module, name)
                self.original_dtypes[qualified] = tensor.dtype
                if is_param:
                    tensor.data = tensor.data.to(dtype)  # keeps the Parameter object
                else:
                    module._buffers[name] = tensor.to(dtype)
        if dtype is not None:
            self._handles.append(
                model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
            )
        if self.output_dtype is not None:
            self._handles.append(model.register_forward_hook(self._cast_outputs))
        if self.fresh_cast_cache:
            guard = _CastCacheGuard()
            for module in model.modules():
                if module._parameters:
                    self._handles.append(module.register_forward_pre_hook(guard))
        if self.original_dtypes:
            # PyTorch tags hook objects, which bound methods do not allow: pass functions.
            def state_dict_hook(*args: Any) -> None:
                self._state_dict_hook(*args)

            def load_hook(*args: Any) -> None:
                self._load_hook(*args)

            self._handles.append(model.register_state_dict_post_hook(state_dict_hook))
            self._handles.append(model.register_load_state_dict_pre_hook(load_hook))

    @property
    def is_cast(self) -> bool:
        """Whether the model's weights or forward were changed (no second initialize then)."""
        return self.cast_model_type is not None or self.output_dtype is not None

    def remove(self) -> None:
        """Remove every hook :meth:`apply` installed (the cast weights stay as they are)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- forward --------------------------------------------------------------------------

    def _cast_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        assert self.cast_model_type is not None
        return cast_floating(args, self.cast_model_type), cast_floating(
            kwargs, self.cast_model_type
        )

    def _cast_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        assert self.output_dtype is not None
        return cast_floating(output, self.output_dtype)

    # -- state dicts ----------------------------------------------------------------------

    def _named_masters(self) -> dict[str, torch.Tensor]:
        by_param = self.masters
        return {name: by_param[p] for name, p in self._model.named_parameters() if p in by_param}

    def _state_dict_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        masters = self._named_masters()
        for name, dtype in self.original_dtypes.items():
            key = prefix + name
            if key not in state_dict:
                continue
            master = masters.get(name)
            state_dict[key] = master.detach() if master is not None else state_dict[key].to(dtype)

    def _load_hook(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The model's own tensors load by copy_ (which casts); the masters are written here.
        with torch.no_grad():
            for name, master in self._named_masters().items():
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)


def model_state(model: nn.Module) -> ModelAmpState | None:
    state = getattr(model, "_amp_state", None)
    return state if isinstance(state, ModelAmpState) else None


def model_master_weights(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """The fp32 master weights amp keeps for ``model``'s half params, by param.

    Under O2 the optimizer steps fp32 copies of the model's half params and writes them back
    after each step; this gives those copies (for a wrapper that must keep them in sync, such as
    a data-parallel broadcast). Empty for a model ``amp.initialize`` did not return, or whose
    optimizer keeps no masters (O0, O1, O3).

    Example:
        >>> masters = model_master_weights(model)
        >>> [masters[p] for p in model.parameters() if p in masters]
    """
    state = model_state(model)
    return {} if state is None else dict(state.masters)
