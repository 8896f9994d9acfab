"""What every fused optimizer shares: the base class with its step plans, ``zero_grad`` and
exact state loading.

The algorithms live in their own modules, the helpers of their steps in
:mod:`amp_optimizers._step_helpers`, the step plans in :mod:`amp_optimizers._step_plan`.
:class:`FusedOptimizerBase` adds Apex's ``set_grad_none`` ``zero_grad``, the per-group
:class:`~amp_optimizers._step_plan.StepPlan` cache, and a ``load_state_dict`` that keeps the
saved state's dtypes (``torch.optim.Optimizer`` would cast float32 state to the dtype of a half
parameter, which is lossy).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import plans_available

from ._step_helpers import first_param_device, holds_dtensors, params_with_grads
from ._step_plan import (
    PLAIN_PLAN,
    TRACE_WRITTEN_GROUP_KEYS,
    StateSnapshot,
    StepPlan,
    param_signature,
    plan_buckets,
    store_plan_lists,
)

__all__ = ["FusedOptimizerBase"]

_GRAD = operator.attrgetter("grad")
# A gradient's layout: torch.strided for a dense one. Reading it costs about a third of reading
# Tensor.is_sparse, and a step reads it for every gradient.
_LAYOUT = operator.attrgetter("layout")


# Attributes a copy builds afresh: the step plans and what they were built from.
_NOT_COPIED = frozenset({"_plans", "_state_snapshot"})


@functools.cache
def _torch_optimizer_attributes() -> frozenset[str]:
    """The attributes ``torch.optim.Optimizer`` sets on every optimizer (its hooks and
    bookkeeping), which its own ``__getstate__`` leaves out and ``__setstate__`` restores."""
    probe = torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})
    return frozenset(vars(probe))


class FusedOptimizerBase(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` plus Apex's ``zero_grad`` and dtype-preserving state loading.

    Subclasses set ``self.set_grad_none`` and implement ``step``.

    Attributes:
        _dummy_overflow_buf: As in Apex, a one-element int32 tensor on the device of the first
            param, the ``noop_flag`` to pass to ``multi_tensor_applier`` (nonzero skips the op;
            some ops set it on inf/nan). It is this optimizer's own flag for that device.
    """

    set_grad_none: bool = True

    # Whether the step can run on lists the compiled kernels hold (StepPlan.lists): a subclass
    # whose step has such an op sets it, calls stored_step_plans, and steps a group whose grads
    # come back None on the plan's lists (docs/design.rst, decision 13).
    _stores_step_plans: bool = False

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

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling (``torch.save(optimizer)``) keep.

        ``torch.optim.Optimizer`` keeps ``defaults``, ``state`` and ``param_groups``: a torch
        optimizer holds all its options there. A fused optimizer also holds options and amp's
        bookkeeping as attributes (Apex's: ``adam_w_mode``, ``capturable``, ...), kept here
        too, so a copy steps as the original would. The step plans are not kept: they hold
        the compiled kernels' handles of this optimizer's lists; a copy builds its own.
        """
        state = super().__getstate__()
        kept = _torch_optimizer_attributes() | _NOT_COPIED
        extra = {k: v for k, v in self.__dict__.items() if k not in state and k not in kept}
        return {**state, **extra}

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
        self,
        name: str,
        state_columns: Callable[[Tensor], Sequence[Tensor]],
        *,
        kind: str = PLAIN_PLAN,
    ) -> list[tuple[dict[str, Any], StepPlan | None, list[Tensor]]]:
        """``(group, plan, grads)`` of :meth:`step_plan` for every param group, in order.

        First checks, once per step, that ``optimizer.state`` holds what the plans were built
        from (:class:`StateSnapshot`): any change of the state that a ``torch.optim`` optimizer
        would see at its next step (a per-param dict cleared, replaced or deleted, a state
        tensor replaced) rebuilds every plan, and state that went missing is re-created by
        ``state_columns``, as on the first step.
        """
        if torch.compiler.is_compiling():
            return [
                (g, *self._traced_plan(name, g, state_columns, kind)) for g in self.param_groups
            ]
        snapshot = self._state_snapshot
        if snapshot is not None and snapshot.matches(self.state):
            return [
                (g, *self.step_plan(name, g, state_columns, kind=kind)) for g in self.param_groups
            ]
        self.invalidate_step_plans()
        plans = [(g, *self.step_plan(name, g, state_columns, kind=kind)) for g in self.param_groups]
        # Each group's plan creates its state: those built before the last one saw a shorter
        # state, which is complete now (else they would all be built again at the next step).
        size = len(self.state)
        self._plans = {key: replace(plan, state_len=size) for key, plan in self._plans.items()}
        self._state_snapshot = StateSnapshot.of(self.state)
        return plans

    def step_plan(
        self,
        name: str,
        group: dict[str, Any],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
        *,
        kind: str = PLAIN_PLAN,
    ) -> tuple[StepPlan | None, list[Tensor]]:
        """The group's step layout and the gradients of this step, in the plan's order.

        Per step this reads each param's ``.grad``, identity, dtype and device; the rest (the
        sparse and dtype checks of :func:`params_with_grads`, the grouping by device and dtype,
        the state lookups and their creation through ``state_columns``) is done again only when
        the layout changed: a param gained or lost its gradient, a param of the group was
        replaced, added or removed, a param's dtype or device changed (``p.data = ...``,
        ``module.half()``), the optimizer's ``state`` was replaced or gained or lost entries, or
        :meth:`invalidate_step_plans` was called (``load_state_dict`` does), or the group's
        plan is of another ``kind``. A step calls it through :meth:`step_plans`, which also
        rebuilds the plans when anything in the state changed.

        Args:
            name: The optimizer's name, for the errors of :func:`params_with_grads`.
            group: The param group.
            state_columns: A param's state tensors, created on first use (e.g. its moments).
            kind: What ``state_columns`` gives, for an optimizer whose steps take different
                columns (FusedAdam's plain and device paths): a group keeps one plan, of the
                kind its last step asked for.

        Returns:
            ``(plan, grads)``, or ``(None, [])`` when no param of the group has a gradient.

        Raises:
            RuntimeError: as :func:`params_with_grads`, when the plan is (re)built.
        """
        if torch.compiler.is_compiling():
            return self._traced_plan(name, group, state_columns, kind)
        params = group["params"]
        grads = list(map(_GRAD, params))
        if not all(map(operator.is_not, grads, repeat(None))):
            params = [p for p, g in zip(params, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
        if not params:
            return None, []
        signature = param_signature(params)
        plan = self._plans.get(id(group))
        if (
            plan is None
            or plan.group is not group
            or plan.signature != signature
            or plan.state is not self.state
            or plan.state_len != len(self.state)
            or plan.generation != self._plan_generation
            or plan.kind != kind
        ):
            plan = self._build_plan(name, group, list(params), signature, state_columns, kind)
        # A sparse gradient is a property of this step's tensors: checked every step (a layout
        # other than strided sends every gradient through the full check, which raises).
        if not all(map(operator.is_, map(_LAYOUT, grads), repeat(torch.strided))):
            params_with_grads(name, plan.params)  # raises on a sparse gradient
        return plan, grads

    def stored_step_plans(
        self, name: str, state_columns: Callable[[Tensor], Sequence[Tensor]]
    ) -> list[tuple[dict[str, Any], StepPlan | None, list[Tensor] | None]]:
        """:meth:`step_plans` for an optimizer that steps on stored lists
        (``_stores_step_plans``): when every group's cached plan holds them and the compiled
        kernels gathered the gradients (:meth:`_gathered_plans`), the groups come back with
        ``grads`` None, and each steps on ``plan.lists``; else as :meth:`step_plans`.
        """
        if self._stores_step_plans and plans_available():
            snapshot = self._state_snapshot
            if snapshot is not None and snapshot.matches(self.state):
                gathered = self._gathered_plans()
                if gathered is not None:
                    return gathered
                # The state was checked: the plans as step_plans gives them, without the check.
                return [(g, *self.step_plan(name, g, state_columns)) for g in self.param_groups]
        return list(self.step_plans(name, state_columns))

    def _gathered_plans(
        self,
    ) -> list[tuple[dict[str, Any], StepPlan | None, list[Tensor] | None]] | None:
        """Every group's cached plan, its gradients read by the compiled kernels; None (nothing
        kept) unless all of them could be: then :meth:`step_plan` decides, as without lists.

        A group qualifies when its plan holds stored lists (:attr:`StepPlan.lists`), is current
        (same group, generation and state size; the caller checked the state) and the group
        holds the same params, and the kernels' gather confirms that the params with a
        gradient, and only they, still have one, all dense, none of another dtype or device
        than planned. A group none of whose params has a gradient qualifies as such (no plan).
        Only then does any group step, so a change anywhere is seen before anything is written.
        """
        out: list[tuple[dict[str, Any], StepPlan | None, list[Tensor] | None]] = []
        gathered = []
        for group in self.param_groups:
            params = group["params"]
            plan = self._plans.get(id(group))
            if plan is None or plan.lists is None:
                if all(map(operator.is_, map(_GRAD, params), repeat(None))):
                    out.append((group, None, []))
                    continue
                break
            if not (
                plan.group is group
                and plan.generation == self._plan_generation
                and plan.state_len == len(self.state)
                and len(params) == len(plan.group_params)
                and all(map(operator.is_, params, plan.group_params))
                and plan.lists.gather()
            ):
                break
            gathered.append(plan.lists)
            out.append((group, plan, None))
        else:
            return out
        for lists in gathered:
            lists.release()
        return None

    def _traced_plan(
        self,
        name: str,
        group: dict[str, Any],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
        kind: str = PLAIN_PLAN,
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
        buckets = plan_buckets(name, params, signature, state_columns)
        plan = StepPlan(
            group,
            signature,
            self.state,
            0,
            -1,
            params,
            buckets,
            holds_dtensors(params),
            kind=kind,
        )
        return plan, grads

    def _build_plan(
        self,
        name: str,
        group: dict[str, Any],
        params: list[Tensor],
        signature: tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]],
        state_columns: Callable[[Tensor], Sequence[Tensor]],
        kind: str = PLAIN_PLAN,
    ) -> StepPlan:
        buckets = plan_buckets(name, params, signature, state_columns)
        sharded = holds_dtensors(params)
        group_params = tuple(group["params"])
        lists = None
        # Only the plain kind's lists are stored: its ops are the ones that step on them.
        stores = self._stores_step_plans and kind == PLAIN_PLAN
        if stores and not sharded and plans_available():
            lists = store_plan_lists(group_params, buckets)
        plan = StepPlan(
            group,
            signature,
            self.state,
            len(self.state),
            self._plan_generation,
            params,
            buckets,
            sharded,
            group_params,
            lists,
            kind,
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

    def noop_flag(self, device: torch.device, *, reset: bool = True) -> Tensor:
        """This optimizer's one-element int32 flag on ``device``, reset to 0 unless the caller
        overwrites it anyway (``reset=False``)."""
        flag = self._noop_flags.get(device)
        if flag is None:
            flag = self._noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        elif reset:
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
            for key in TRACE_WRITTEN_GROUP_KEYS:
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
