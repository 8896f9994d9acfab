"""What ``amp.initialize`` does to a model: the cast (O2/O3), input/output casting, state dicts.

Every change is made through PyTorch's module hooks and recorded on the model's
:class:`ModelAmpState` (``model._amp_state``), so :meth:`ModelAmpState.remove` undoes it.

One truth per weight: under O2 the fp32 master (stepped by the optimizer) is the truth of a
half param, and the hooks find it through the model at call time (``model._amp_state``, then the
optimizers' :class:`~amp_core._master_weights.MasterWeights`), so a copy of the model reaches its
own record, never the original's masters.

State dicts: the model's ``state_dict()`` holds fp32 tensors for everything amp cast, under every
name of a shared (tied) param: the fp32 master weights where the optimizer keeps them (in-place
edits of the half params taken in first), otherwise the cast tensor widened back. Loading a
state dict writes the master weights too, so that a resumed O2 run is bitwise identical to an
uninterrupted one, and checkpoints move freely between opt levels and plain fp32 models. A deep
copy or an unpickled copy has no masters and exports its own tensors as they are.

:meth:`ModelAmpState.remove` (``amp.close()``) gives every cast tensor its dtype from before the
cast back, with the master's value where there is one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ._master_weights import MasterWeights

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


# Every dict in which PyTorch keeps a module's hooks, by handle id (ids are process-wide).
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # Resolved through the module at call time: a copy of the model reaches its own record.
    state = model_state(module)
    if state is not None and state.model is module:
        state.export(state_dict, prefix)


def _load_pre_hook(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    state = model_state(module)
    if state is not None and state.model is module:
        state.load_masters(state_dict, prefix)


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    state = model_state(module)
    if state is not None and state.model is module:
        state.note_loaded()


class ModelAmpState:
    """Amp's record on one model (``model._amp_state``).

    The fp32 master weights are not kept here: they are looked up, when needed, in the
    optimizers of the same ``amp.initialize`` call (:attr:`masters`), which step them. A deep
    copy or an unpickled copy of the model gets a record of its own with the same forward
    casting and no masters (it has no optimizer): its ``state_dict()`` returns its own tensors,
    as they are, so that code writing into them in place (an EMA) updates the copy.

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
        # The masters of the optimizers of the same initialize call, which step them (held
        # without the optimizers, whose session must not live as long as the model).
        self._weights: list[MasterWeights] = []
        # Whether this record is a copy's (deep copy, unpickling): no masters, no widening.
        self.is_copy = False
        # (module, hook id) of every hook apply() installed: removable from a copy too.
        self._hook_ids: list[tuple[nn.Module, int]] = []
        self._model = model

    @property
    def model(self) -> nn.Module:
        """The model this record belongs to."""
        return self._model

    def attach(self, weights: MasterWeights) -> None:
        """Look this model's masters up in ``weights``, an optimizer's (same ``initialize``
        call); a param group added to it later is found there too."""
        self._weights.append(weights)

    @property
    def masters(self) -> dict[nn.Parameter, torch.Tensor]:
        """Model param -> its fp32 master, from the optimizers that step them (now)."""
        params = {id(p) for p in self._model.parameters()}
        found: dict[nn.Parameter, torch.Tensor] = {}
        for weights in self._weights:
            for param, master in weights.pairs():
                if id(param) in params:
                    found[param] = master  # type: ignore[index]
        return found

    def take_model_edits(self, *, strict: bool = True) -> None:
        """Take in-place edits of the model's half params into their masters (see
        :meth:`MasterWeights.take_model_edits`)."""
        for weights in self._weights:
            weights.take_model_edits(strict=strict)

    # -- copies ------------------------------------------------------------------------------

    def _copy_state(self, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        state["_weights"] = []
        state["is_copy"] = True
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelAmpState:
        # The model's deep copy reaches its record through model._amp_state: the copy's modules
        # and tensors come from ``memo``; its optimizers are not copied (no masters).
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self._copy_state(self.__dict__).items():
            setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __getstate__(self) -> dict[str, Any]:
        return self._copy_state(self.__dict__)

    # -- apply and remove --------------------------------------------------------------------

    def apply(self) -> None:
        """Cast the planned tensors and install the hooks."""
        model, dtype = self._model, self.cast_model_type
        before: dict[int, torch.dtype] = {}  # by tensor: a tied one is planned under each name
        with torch.no_grad():
            for qualified, module, name, is_param in self.plan:
                assert dtype is not None
                tensor = getattr(module, name)
                self.original_dtypes[qualified] = before.setdefault(id(tensor), tensor.dtype)
                if tensor.dtype == dtype:
                    continue  # tied to a tensor cast under another name
                if is_param:
                    tensor.data = tensor.data.to(dtype)  # keeps the Parameter object
                else:
                    module._buffers[name] = tensor.to(dtype)
        hooks: list[tuple[nn.Module, RemovableHandle]] = []
        if dtype is not None:
            hooks.append(
                (model, model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
            )
        if self.output_dtype is not None:
            hooks.append((model, model.register_forward_hook(self._cast_outputs)))
        if self.fresh_cast_cache:
            guard = _CastCacheGuard()
            for module in model.modules():
                if module._parameters:
                    hooks.append((module, module.register_forward_pre_hook(guard)))
        if self.original_dtypes:
            hooks.append((model, model.register_state_dict_post_hook(_state_dict_hook)))
            hooks.append((model, model.register_load_state_dict_pre_hook(_load_pre_hook)))
            hooks.append((model, model.register_load_state_dict_post_hook(_load_post_hook)))
        self._hook_ids = [(module, handle.id) for module, handle in hooks]

    @property
    def is_cast(self) -> bool:
        """Whether the model's weights or forward were changed (no second initialize then)."""
        return self.cast_model_type is not None or self.output_dtype is not None

    def remove(self) -> None:
        """Undo :meth:`apply`: the cast tensors go back to their dtypes from before the cast
        (a param with a master takes the master's value), and every hook is removed."""
        self.restore_dtypes()
        for module, hook_id in self._hook_ids:
            for attr in _HOOK_DICTS:
                getattr(module, attr, {}).pop(hook_id, None)
        self._hook_ids = []

    def restore_dtypes(self) -> None:
        """Give every tensor the cast changed its dtype from before the cast: the master's value
        for a param with a master (after taking in-place edits), the widened value otherwise."""
        self.take_model_edits(strict=False)
        masters = self.masters
        with torch.no_grad():
            for qualified, module, name, is_param in self.plan:
                original = self.original_dtypes.get(qualified)
                tensor = getattr(module, name, None)
                if original is None or tensor is None or tensor.dtype == original:
                    continue
                if is_param:
                    master = masters.get(tensor)
                    if master is not None and master.shape != tensor.shape:
                        master = None  # its data was replaced: the model's value stands
                    source = master.detach() if master is not None else tensor.data
                    tensor.data = source.to(original, copy=True)
                else:
                    module._buffers[name] = tensor.to(original)

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
        """Qualified name -> master, under every name of a shared (tied) param."""
        by_param = self.masters
        return {
            name: by_param[p]
            for name, p in self._model.named_parameters(remove_duplicate=False)
            if p in by_param
        }

    def export(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Put the truth of each cast tensor into ``state_dict`` (the model's ``state_dict()``):
        its fp32 master where it has one (edits taken in first), else the model's tensor widened
        to its dtype from before the cast, or, for a copy's record, the tensor itself."""
        self.take_model_edits()
        masters = self._named_masters()
        for name, dtype in self.original_dtypes.items():
            key = prefix + name
            if key not in state_dict:
                continue
            master = masters.get(name)
            if master is not None:
                state_dict[key] = master.detach()
            elif not self.is_copy:
                state_dict[key] = state_dict[key].to(dtype)

    def load_masters(self, state_dict: Mapping[str, Any], prefix: str) -> None:
        """Write the loaded values into the masters (the model's own tensors load by
        ``copy_``, which casts, after this)."""
        self.take_model_edits()  # a key the state dict lacks keeps its edited value
        with torch.no_grad():
            for name, master in self._named_masters().items():
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)

    def note_loaded(self) -> None:
        """After a load: the model's half params hold the masters' values, edits or not."""
        for weights in self._weights:
            weights.note_model_versions()


def model_state(model: nn.Module) -> ModelAmpState | None:
    state = getattr(model, "_amp_state", None)
    return state if isinstance(state, ModelAmpState) else None


def model_master_weights(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """The fp32 master weights amp keeps for ``model``'s half params, by param.

    Under O2 the optimizer steps fp32 copies of the model's half params and writes them back
    after each step; this gives those copies (for a wrapper that must keep them in sync, such as
    a data-parallel broadcast), with in-place edits of the half params taken in first. Empty for
    a model ``amp.initialize`` did not return (a deep copy of one included), or whose optimizer
    keeps no masters (O0, O1, O3), or after ``amp.close()``.

    Example:
        >>> masters = model_master_weights(model)
        >>> [masters[p] for p in model.parameters() if p in masters]
    """
    state = model_state(model)
    if state is None:
        return {}
    state.take_model_edits()
    return state.masters
