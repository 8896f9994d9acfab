"""What every fused optimizer shares: grouping, validation, ``zero_grad``, exact state loading.

The algorithms live in their own modules; this one only holds the plumbing, written once:

* :func:`group_by_device_dtype` sorts per-parameter tensor tuples into one bucket per
  ``(device, dtype)`` so that each optimizer launches one multi-tensor op per bucket instead of
  one hand-written launch per dtype.
* :class:`FusedOptimizerBase` adds Apex's ``set_grad_none`` ``zero_grad`` and a
  ``load_state_dict`` that keeps the saved state's dtypes (``torch.optim.Optimizer`` would cast
  float32 state to the dtype of a half parameter, which is lossy).
* :class:`StepPlan` keeps what a step of one param group needs that does not depend on the
  tensor values (which params have a gradient, the buckets, the checked preconditions, the
  state tensors), so that a step with the same layout as the last one only gathers the
  gradients; see :meth:`FusedOptimizerBase.step_plans` for when a plan is rebuilt.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AmpCOp",
    "FusedOptimizerBase",
    "PlanBucket",
    "StateSnapshot",
    "StepPlan",
    "advance_step",
    "step_arguments",
    "check_betas",
    "check_nonnegative",
    "first_param_device",
    "group_by_device_dtype",
    "local_shards",
    "outside_graph",
    "params_with_grads",
    "step_outside_graph",
    "unscale_grads_in_place",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def advance_step(holder: dict[str, Any], key: str = "step") -> int | Tensor:
    """Add one to the step count ``holder[key]`` (a param group or a param's state) and return it.

    In eager mode the count is a Python int, as Apex keeps it. Under ``torch.compile`` an int
    that changes every step would be a constant of the graph, recompiled each step; there the
    count becomes a one-element int64 CPU tensor advanced in place, data of one graph that
    serves every step (``docs/compile.rst``). Once a tensor, it stays one, also in eager mode.
    A count on another device (a capturable optimizer's) is advanced there.
    """
    count = holder.get(key, 0)
    if isinstance(count, Tensor):
        count.add_(1)
        return count
    if torch.compiler.is_compiling():
        tensor = torch.tensor(int(count) + 1, dtype=torch.int64)
        holder[key] = tensor
        return tensor
    holder[key] = int(count) + 1
    return holder[key]


def step_arguments(step: int | Tensor) -> tuple[int, Tensor | None]:
    """``(step, step_tensor)`` for an op with Apex's ``int step`` and the optional
    ``step_tensor``: a tensor count goes in ``step_tensor`` (on the CPU: the kernels read it on
    the host), and ``step`` is then 0 and unread."""
    if isinstance(step, Tensor):
        return 0, step if step.device.type == "cpu" else step.to("cpu")
    return step, None


Bucket = list[list[Tensor]]


def check_nonnegative(optimizer: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number >= 0, or a one-element floating
    tensor holding one (read back once, at construction)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{optimizer}: invalid {name}: a tensor {name} must hold one floating-point "
                f"value, got shape {tuple(value.shape)} and dtype {value.dtype}; pass e.g. "
                "torch.tensor(1e-3)"
            )
        number = float(value.detach().reshape(()).item())
        if not number >= 0.0 or not math.isfinite(number):
            raise ValueError(
                f"{optimizer}: invalid {name} {number!r} (a tensor); it must be a finite "
                "number >= 0"
            )
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0:
        raise ValueError(f"{optimizer}: invalid {name} {value!r}; it must be a number >= 0")
    if not math.isfinite(value):
        raise ValueError(f"{optimizer}: invalid {name} {value!r}; it must be finite")


def unscale_grads_in_place(grads: Sequence[Tensor], grad_scale: Tensor) -> None:
    """Divide ``grads`` by ``grad_scale`` in place, on their devices (no host sync).

    What ``torch.amp.GradScaler`` leaves behind for a plain optimizer (it unscales ``.grad``
    in place): an optimizer that unscales inside its step calls this after it, so code that
    reads the gradients after ``scaler.step(optimizer)`` sees the same values either way.
    """
    inv = grad_scale.double().reciprocal().float().reshape(())
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, inv.to(device))


def local_shards(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` with every DTensor (FSDP2 param or state) replaced by its local shard.

    Under ``torch.compile`` (which steps plain params here) ``tensors`` as they are.
    """
    if torch.compiler.is_compiling():
        return tensors
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def step_outside_graph(param_groups: Iterable[dict[str, Any]]) -> bool:
    """Whether a step of an optimizer that takes norms of whole tensors (LAMB, NovoGrad) runs
    outside the graph: under ``torch.compile``, with DTensor (FSDP2) params.

    Such a step all-reduces the shards' partial norms over the ranks in the ops' PyTorch
    reference (``docs/large_models.rst``). Traced, it breaks the graph at host reads inside
    loops, recompiles as the step count changes, and the state it creates in a graph of
    DTensors of uneven shards took another rank's local shape. Run as in eager mode (one graph
    break, :func:`outside_graph`), it gives the eager result on every rank.
    """
    if not torch.compiler.is_compiling():
        return False
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and any(
        isinstance(p, dtensor) for group in param_groups for p in group["params"]
    )


_eager_call: Callable[..., Any] | None = None


def outside_graph(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run eagerly while ``torch.compile`` traces (one graph break).

    ``torch.compiler.disable`` imports ``torch._dynamo``, which importing this package must
    not: the wrapper is made on first use, always under ``torch.compile``.
    """
    global _eager_call
    if _eager_call is None:
        _eager_call = torch.compiler.disable(_call)
    return _eager_call(fn, *args, **kwargs)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def check_betas(optimizer: str, betas: Any) -> None:
    """Raise ``ValueError`` unless ``betas`` is a pair of numbers in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{optimizer}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"{optimizer}: invalid beta parameter at index {i}: {beta!r}; "
                "each beta must be in [0, 1)"
            )


def params_with_grads(optimizer: str, params: Iterable[Tensor]) -> list[Tensor]:
    """The params of a group that have a gradient, after checking sparsity and dtype.

    Raises:
        RuntimeError: A gradient is sparse, or a param is not float32/float16/bfloat16.
    """
    out = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(
                f"{optimizer} does not support sparse gradients, please consider SparseAdam instead"
            )
        if p.dtype not in _SUPPORTED_DTYPES:
            raise RuntimeError(
                f"{optimizer} supports float32, float16 and bfloat16 params, got {p.dtype}; "
                "cast the model with .float(), .half() or .bfloat16()"
            )
        out.append(p)
    return out


def group_by_device_dtype(
    rows: Iterable[Sequence[Any]],
) -> dict[tuple[torch.device, torch.dtype], Bucket]:
    """Transpose per-param rows into per-``(device, dtype)`` column lists.

    Args:
        rows: One tuple per param, its first element the param itself, e.g.
            ``(param, grad, exp_avg, exp_avg_sq)``.

    Returns:
        ``{(device, dtype): [column_0, column_1, ...]}`` with the key taken from the param, the
        columns in row order: exactly the ``tensor_lists`` of one multi-tensor launch.
    """
    buckets: dict[tuple[torch.device, torch.dtype], Bucket] = {}
    for row in rows:
        key = (row[0].device, row[0].dtype)
        columns = buckets.get(key)
        if columns is None:
            columns = buckets[key] = [[] for _ in row]
        for column, tensor in zip(columns, row, strict=True):
            column.append(tensor)
    return buckets


class AmpCOp:
    """A class attribute that reads the ``amp_C`` op of the given name (Apex's op handles).

    Apex's fused optimizers bind their multi-tensor ops in the constructor
    (``self.multi_tensor_adam = amp_C.multi_tensor_adam``) and code built on them reads those
    handles (fairseq's ``FusedAdam`` subclass refuses to run without ``multi_tensor_adam``) and
    calls them through ``multi_tensor_applier`` with Apex's arguments. The handle is looked up
    by name on ``amp_fused_ops.amp_C`` when read, so it is exactly that op; an op the installed
    amp-fused-ops does not provide reads as a missing attribute (``hasattr`` is False). An
    instance may assign its own handle over it, as with any attribute.

    Args:
        op_name: The name of the op in ``amp_C``.
    """

    def __init__(self, op_name: str) -> None:
        self.op_name = op_name

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr_name = name

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        from amp_fused_ops import amp_C

        op = getattr(amp_C, self.op_name, None)
        if op is None:
            raise AttributeError(
                f"{getattr(objtype, '__name__', 'optimizer')}.{self.attr_name}: the installed "
                f"amp-fused-ops has no amp_C.{self.op_name}; upgrade amp-fused-ops"
            )
        return op


def first_param_device(param_groups: Iterable[dict[str, Any]]) -> torch.device:
    """The device of the first param of the first non-empty group (CPU when there is none)."""
    for group in param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


# Param-group keys that torch.compile writes into a traced step's groups (see
# FusedOptimizerBase.state_dict); none of them is an option of a fused optimizer.
_TRACE_WRITTEN_GROUP_KEYS = ("capturable",)

_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


@dataclass(frozen=True)
class PlanBucket:
    """The params of one ``(device, dtype)`` of a group and their state tensors.

    Attributes:
        device: Where they live.
        index: Positions of the bucket's params among the group's params with a gradient, or
            ``None`` when the bucket holds all of them (the usual case: one bucket).
        columns: ``[params, state_column_0, ...]``, the lists passed to the multi-tensor op.
    """

    device: torch.device
    index: list[int] | None
    columns: list[list[Tensor]]

    def grads(self, grads: list[Tensor]) -> list[Tensor]:
        """The bucket's gradients, out of the group's list (in the order of ``columns``)."""
        return grads if self.index is None else [grads[i] for i in self.index]


@dataclass(frozen=True)
class StepPlan:
    """One param group's step layout, valid while nothing it was built from changed.

    Attributes:
        group: The param group it was built for (identity).
        signature: Identity, dtype and device of each param with a gradient, in order.
        state: The optimizer's state mapping it read (identity) and its length then.
        generation: The optimizer's plan generation (bumped by ``load_state_dict`` etc.).
        params: The params with a gradient.
        buckets: One per ``(device, dtype)``, in the order of first appearance.
    """

    group: dict[str, Any]
    signature: tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]]
    state: Any
    state_len: int
    generation: int
    params: list[Tensor]
    buckets: list[PlanBucket]


_END = object()  # closes the sequence of a snapshot's objects, so that a length change shows


def _state_objects(state: Any) -> Iterable[Any]:
    """The params keyed in ``state``, then every value of every per-param dict, then the end."""
    return chain(state.keys(), chain.from_iterable(map(dict.values, state.values())), (_END,))


@dataclass(frozen=True)
class StateSnapshot:
    """What an optimizer's ``state`` held when its step plans were last built, by identity.

    torch.optim reads ``optimizer.state[p][key]`` at every step; a plan holds the state tensors
    instead. The plans stay valid while this snapshot matches (:meth:`matches`): the same
    ``state`` mapping, keyed by the same params in the same order, and the same objects in its
    per-param dicts, in the same order and as many. So a state cleared or replaced in any way
    (``state.clear()``, ``del state[p]``, ``state[p] = {}``, ``state[p].clear()``,
    ``state[p]["exp_avg"] = t``, the state moved to another device and back, a param's state
    moved to another param) rebuilds the plans, which re-create missing state as the first
    step did. A per-param dict replaced by another that holds the same tensors changes nothing
    a step reads, and is not looked at.

    The check reads no tensor and hashes no param: one C-level pass over the state's keys and
    values, compared by identity.
    """

    mapping: Any
    objects: list[Any]

    @classmethod
    def of(cls, state: Any) -> StateSnapshot:
        try:
            objects = list(_state_objects(state))
        except TypeError:  # an entry that is not a dict: nothing is cached (never matches)
            objects = [object()]
        return cls(state, objects)

    def matches(self, state: Any) -> bool:
        """Whether ``state`` still holds exactly what it held when this snapshot was taken."""
        if state is not self.mapping:
            return False
        try:
            return all(map(operator.is_, _state_objects(state), self.objects))
        except TypeError:
            return False


def _signature(
    params: list[Tensor],
) -> tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]]:
    return tuple(map(id, params)), tuple(map(_DTYPE, params)), tuple(map(_DEVICE, params))


def _plan_buckets(
    name: str,
    params: list[Tensor],
    signature: tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]],
    state_columns: Callable[[Tensor], Sequence[Tensor]],
) -> list[PlanBucket]:
    """The checks of :func:`params_with_grads`, then the params and their state by bucket."""
    params_with_grads(name, params)  # raises on a sparse gradient or an unsupported dtype
    rows = [(p, *state_columns(p)) for p in params]
    keys = list(zip(signature[2], signature[1], strict=True))
    buckets = []
    for key, columns in group_by_device_dtype(rows).items():
        index = (
            None if len(columns[0]) == len(params) else [i for i, k in enumerate(keys) if k == key]
        )
        buckets.append(PlanBucket(key[0], index, columns))
    return buckets


class FusedOptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` plus Apex's ``zero_grad`` and dtype-preserving state loading.

    Subclasses set ``self.set_grad_none`` and implement ``step``.

    Attributes:
        _dummy_overflow_buf: As in Apex, a one-element int32 tensor on the device of the first
            param, the ``noop_flag`` to pass to ``multi_tensor_applier`` (nonzero skips the op;
            some ops set it on inf/nan). It is this optimizer's own flag for that device.
    """

    set_grad_none: bool = True

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._noop_flags: dict[torch.device, Tensor] = {}
        self._plans: dict[int, StepPlan] = {}  # by id of the param group
        self._plan_generation = 0
        self._state_snapshot: StateSnapshot | None = None  # what the plans were built from
        self._dummy_overflow_buf = self.noop_flag(first_param_device(self.param_groups))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: set them to ``None`` when ``set_grad_none`` (Apex), else zero.

        Args:
            set_to_none: Overrides ``set_grad_none`` for this call when given.
        """
        to_none = self.set_grad_none if set_to_none is None else set_to_none
        if to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad(set_to_none=False)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.invalidate_step_plans()  # also gives an optimizer pickled without plans its own

    def amp_check_initialize(self, *, master_weights: bool, cast: torch.dtype | None) -> None:
        """Refuse an ``amp.initialize`` call this optimizer could not step; amp calls it before
        it changes anything, so the models and the optimizer are left as they were.

        A param group with ``bf16_stochastic_round=True`` rounds its bfloat16 params itself: it
        cannot step float32 master weights (O2, ``master_weights=True``) nor params cast to
        another dtype (O0's float32, an fp16 O3).

        Raises:
            ValueError: naming the group, the call's setting and the fix.
        """
        name = type(self).__name__
        for index, group in enumerate(self.param_groups):
            if not group.get("bf16_stochastic_round", False):
                continue
            if master_weights:
                raise ValueError(
                    f"{name}: param group {index} has bf16_stochastic_round=True, which rounds "
                    "the bfloat16 params themselves and cannot be combined with the float32 "
                    "master weights of amp.initialize (opt_level O2 or master_weights=True); "
                    "use opt_level='O3' with half_dtype=torch.bfloat16 (or O1), or "
                    "bf16_stochastic_round=False. Nothing was changed."
                )
            if cast is not None and cast is not torch.bfloat16:
                raise ValueError(
                    f"{name}: param group {index} has bf16_stochastic_round=True, which needs "
                    f"bfloat16 params, and amp.initialize would cast the model to {cast}; "
                    "pass half_dtype=torch.bfloat16 (or cast_model_type=False to keep the "
                    "model's dtypes), or bf16_stochastic_round=False. Nothing was changed."
                )

    def invalidate_step_plans(self) -> None:
        """Forget every cached :class:`StepPlan` (the next step rebuilds them)."""
        self._plans = {}
        self._plan_generation = getattr(self, "_plan_generation", 0) + 1
        self._state_snapshot = None

    def step_plans(
        self, name: str, state_columns: Callable[[Tensor], Sequence[Tensor]]
    ) -> list[tuple[dict[str, Any], StepPlan | None, list[Tensor]]]:
        """``(group, plan, grads)`` of :meth:`step_plan` for every param group, in order.

        First checks, once per step, that ``optimizer.state`` holds what the plans were built
        from (:class:`StateSnapshot`): any change of the state that a ``torch.optim`` optimizer
        would see at its next step (a per-param dict cleared, replaced or deleted, a state
        tensor replaced) rebuilds every plan, and state that went missing is re-created by
        ``state_columns``, as on the first step.
        """
        if torch.compiler.is_compiling():
            return [(g, *self._traced_plan(name, g, state_columns)) for g in self.param_groups]
        snapshot = self._state_snapshot
        if snapshot is not None and snapshot.matches(self.state):
            return [(g, *self.step_plan(name, g, state_columns)) for g in self.param_groups]
        self.invalidate_step_plans()
        plans = [(g, *self.step_plan(name, g, state_columns)) for g in self.param_groups]
        self._state_snapshot = StateSnapshot.of(self.state)
        return plans

    def step_plan(
        self,
        name: str,
        group: dict[str, Any],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
    ) -> tuple[StepPlan | None, list[Tensor]]:
        """The group's step layout and the gradients of this step, in the plan's order.

        Per step this reads each param's ``.grad``, identity, dtype and device; the rest (the
        sparse and dtype checks of :func:`params_with_grads`, the grouping by device and dtype,
        the state lookups and their creation through ``state_columns``) is done again only when
        the layout changed: a param gained or lost its gradient, a param of the group was
        replaced, added or removed, a param's dtype or device changed (``p.data = ...``,
        ``module.half()``), the optimizer's ``state`` was replaced or gained or lost entries, or
        :meth:`invalidate_step_plans` was called (``load_state_dict`` does). A step calls it
        through :meth:`step_plans`, which also rebuilds the plans when anything in the state
        changed.

        Args:
            name: The optimizer's name, for the errors of :func:`params_with_grads`.
            group: The param group.
            state_columns: A param's state tensors, created on first use (e.g. its moments).

        Returns:
            ``(plan, grads)``, or ``(None, [])`` when no param of the group has a gradient.

        Raises:
            RuntimeError: as :func:`params_with_grads`, when the plan is (re)built.
        """
        if torch.compiler.is_compiling():
            return self._traced_plan(name, group, state_columns)
        params = group["params"]
        grads = list(map(_GRAD, params))
        if not all(map(operator.is_not, grads, repeat(None))):
            params = [p for p, g in zip(params, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
        if not params:
            return None, []
        signature = _signature(params)
        plan = self._plans.get(id(group))
        if (
            plan is None
            or plan.group is not group
            or plan.signature != signature
            or plan.state is not self.state
            or plan.state_len != len(self.state)
            or plan.generation != self._plan_generation
        ):
            plan = self._build_plan(name, group, list(params), signature, state_columns)
        # A sparse gradient is a property of this step's tensors: checked every step.
        if any(map(_IS_SPARSE, grads)):
            params_with_grads(name, plan.params)  # raises
        return plan, grads

    def _traced_plan(
        self,
        name: str,
        group: dict[str, Any],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
    ) -> tuple[StepPlan | None, list[Tensor]]:
        """:meth:`step_plan` while ``torch.compile`` traces: built every time, never cached.

        The compiled step is guarded on these params by Dynamo itself; the cache's identity
        bookkeeping (``id``, ``operator.attrgetter``) is host work Dynamo does not trace.
        """
        pairs = [(p, p.grad) for p in group["params"] if p.grad is not None]
        if not pairs:
            return None, []
        params = [p for p, _ in pairs]
        grads = [g for _, g in pairs]
        signature = ((), tuple(p.dtype for p in params), tuple(p.device for p in params))
        buckets = _plan_buckets(name, params, signature, state_columns)
        return StepPlan(group, signature, self.state, 0, -1, params, buckets), grads

    def _build_plan(
        self,
        name: str,
        group: dict[str, Any],
        params: list[Tensor],
        signature: tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
    ) -> StepPlan:
        buckets = _plan_buckets(name, params, signature, state_columns)
        plan = StepPlan(
            group, signature, self.state, len(self.state), self._plan_generation, params, buckets
        )
        live = {id(g) for g in self.param_groups}
        self._plans = {k: v for k, v in self._plans.items() if k in live}
        self._plans[id(group)] = plan
        return plan

    def candidate_group(self, param_group: Any) -> dict[str, Any] | None:
        """The group :meth:`add_param_group` would append for ``param_group``, to check it first.

        A copy with the defaults filled in and ``"params"`` a list of tensors (named params
        unpacked), as ``torch.optim.Optimizer.add_param_group`` makes it; an iterator of params
        is read into a list in ``param_group`` itself (as torch would). ``None`` where torch
        refuses the group on its own (not a dict, no params, params in a set): a subclass that
        refuses groups checks the candidate, so that a refused group is never appended.
        """
        if not isinstance(param_group, dict) or "params" not in param_group:
            return None
        params = param_group["params"]
        if isinstance(params, set):
            return None
        if isinstance(params, Tensor):
            tensors = [params]
        else:
            param_group["params"] = params = list(params)
            tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
        return {**self.defaults, **param_group, "params": tensors}

    def noop_flag(self, device: torch.device) -> Tensor:
        """This optimizer's one-element int32 flag on ``device``, reset to 0."""
        flag = self._noop_flags.get(device)
        if flag is None:
            flag = self._noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        else:
            flag.zero_()
        return flag

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer``'s state dict, without the keys a compiled step wrote.

        ``torch.compile`` treats a traced ``step`` as that of a ``torch.optim`` optimizer and
        writes ``capturable=True`` into every param group whose dict the step changed (e.g.
        its step count). No fused optimizer has such a group option (``FusedAdam``'s
        ``capturable`` is an attribute), and ``torch.optim.AdamW`` refuses to step CPU params of
        a group so marked: the saved groups leave it out, so that a state dict saved after
        compiled steps is the one eager steps would have saved.
        """
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            for key in _TRACE_WRITTEN_GROUP_KEYS:
                group.pop(key, None)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict`, keeping each saved tensor's dtype.

        ``torch.optim.Optimizer`` casts floating-point state to the dtype of its param; the
        fused optimizers keep float32 state for half params, so the saved tensors are put back
        unchanged (moved to the param's device), and a round trip is bitwise.
        """
        saved_state = state_dict["state"]
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        self.invalidate_step_plans()
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, param in zip(saved_ids, params, strict=False):
            saved = saved_state.get(pid)
            if saved is None:
                continue
            restored = self.state[param]
            for key, value in saved.items():
                if isinstance(value, Tensor):
                    restored[key] = value.to(device=param.device, copy=True)
        for group in self.param_groups:
            self._after_load_group(group)

    def _after_load_group(self, group: dict[str, Any]) -> None:
        """Hook: fix up a loaded param group (e.g. move capturable tensors to the device)."""

    @staticmethod
    def _run_closure(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
