"""Step plans: what a param group's step needs that does not depend on the tensor values.

A :class:`StepPlan` holds which params have a gradient, their buckets by ``(device, dtype)``
(:class:`PlanBucket`) with the state tensors, and the checked preconditions, so that a step
with the same layout as the last one only gathers the gradients. A :class:`StateSnapshot`
says whether the optimizer's ``state`` still holds what the plans were built from; see
:meth:`amp_optimizers._base.FusedOptimizerBase.step_plans` for when a plan is rebuilt.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import StepPlanLists

from ._step_helpers import group_by_device_dtype, params_with_grads

__all__ = [
    "TRACE_WRITTEN_GROUP_KEYS",
    "PlanBucket",
    "StateSnapshot",
    "StepPlan",
    "param_signature",
    "plan_buckets",
    "store_plan_lists",
]

# Param-group keys that torch.compile writes into a traced step's groups (see
# FusedOptimizerBase.state_dict); none of them is an option of a fused optimizer.
TRACE_WRITTEN_GROUP_KEYS = ("capturable",)

PLAIN_PLAN = "plain"
"""The :attr:`StepPlan.kind` of a plan whose columns are the params and their optimizer state."""

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
        sharded: Some param is a DTensor (FSDP2): the step calls the ops' sharded form
            (``amp_fused_ops.multi_tensor_op(name, sharded=True)``).
        group_params: All the group's params when the plan was built, those without a
            gradient included (for the check of a step that reads no gradient in Python).
        lists: The same lists stored with the compiled kernels of the params' device
            (``amp_fused_ops.StepPlanLists``), for an optimizer that steps on them; None where
            they are not stored.
        kind: Which state columns the buckets hold (:data:`PLAIN_PLAN` unless the optimizer
            steps different columns on different paths).
    """

    group: dict[str, Any]
    signature: tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]]
    state: Any
    state_len: int
    generation: int
    params: list[Tensor]
    buckets: list[PlanBucket]
    sharded: bool = False
    group_params: tuple[Tensor, ...] = ()
    lists: StepPlanLists | None = None
    kind: str = PLAIN_PLAN


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


def param_signature(
    params: list[Tensor],
) -> tuple[tuple[int, ...], tuple[torch.dtype, ...], tuple[torch.device, ...]]:
    return tuple(map(id, params)), tuple(map(_DTYPE, params)), tuple(map(_DEVICE, params))


def plan_buckets(
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


def store_plan_lists(
    group_params: Sequence[Tensor], buckets: Sequence[PlanBucket]
) -> StepPlanLists | None:
    """The lists of ``buckets`` stored with the compiled kernels (:class:`StepPlanLists`), or
    None where they cannot be (see :meth:`StepPlanLists.create`).

    Args:
        group_params: The group's params in order, those without a gradient included.
        buckets: The plan's buckets (their params are those with a gradient).
    """
    bucket_of: dict[int, int] = {}
    state_of: dict[int, list[Tensor]] = {}
    for index, bucket in enumerate(buckets):
        params, *state = bucket.columns
        for row, p in enumerate(params):
            bucket_of[id(p)] = index
            state_of[id(p)] = [column[row] for column in state]
    columns = len(buckets[0].columns) - 1 if buckets else 0
    planned = [p for p in group_params if id(p) in bucket_of]
    return StepPlanLists.create(
        list(group_params),
        [bucket_of.get(id(p), -1) for p in group_params],
        [[state_of[id(p)][c] for p in planned] for c in range(columns)],
    )
