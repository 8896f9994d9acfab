"""FusedAdam's plain step and FusedSGD's step on the lists the compiled kernels hold
(``multi_tensor_adam_plan``, ``multi_tensor_sgd_plan``).

Once a group's layout is planned, the step passes no tensor lists: the compiled kernels keep
the params and the state, read the gradients off the params, and step. Each test runs the
same steps twice, on the stored lists and on lists passed per step (the same kernels: the
optimizer's ``_stores_step_plans`` switched off), and requires the same bits, across the
changes a stored plan must notice; and checks that the kernels hold no tensor longer than the
plan, nor a gradient longer than the step.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from _amp_optimizers_helpers import (
    GROUP_SHAPES,
    assert_bitwise_equal,
    loss_of,
    make_params,
    run_steps,
    snapshot,
    two_groups,
)
from amp_fused_ops import StepPlanLists, plans_available
from amp_optimizers import FusedAdam, FusedSGD

pytestmark = pytest.mark.skipif(
    StepPlanLists.create([torch.ones(1)], [0], [[torch.ones(1)]]) is None,
    reason="the step plans need the compiled CPU kernels",
)

OPS = torch.ops.amp_fused_ops
BF16 = torch.bfloat16
MIXED = [torch.float32, BF16, torch.float32, torch.float32, BF16, torch.float32, BF16, BF16]


# name -> (the optimizer of two groups, the list op its step calls)
OPTIMIZERS: dict[str, tuple[Callable[[list[dict[str, Any]]], Any], str]] = {
    "adam": (lambda groups: FusedAdam(groups, lr=1e-2, weight_decay=0.1), "multi_tensor_adam"),
    "sgd": (
        lambda groups: FusedSGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.1),
        "multi_tensor_sgd",
    ),
}


def _twins(
    name: str = "adam", dtype: torch.dtype | list[torch.dtype] = torch.float32
) -> Iterator[tuple[Any, list[Tensor]]]:
    """The same params and optimizer twice: stepping on stored lists, then on passed lists."""
    make = OPTIMIZERS[name][0]
    for stored in (True, False):
        params = make_params(dtype=dtype)
        optimizer = make(two_groups(params, {"weight_decay": 0.0}))
        optimizer._stores_step_plans = stored
        yield optimizer, params


def _calls(step: Callable[[], None]) -> list[str]:
    """The names of this package's ops a call runs (the profiler: no dispatch mode)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return [e.name for e in prof.events() if e.name.startswith("amp_fused_ops::")]


def _values(optimizer: Any, params: list[Tensor]) -> list[object]:
    """The params and their state (a param taken out of its group has state torch's
    ``state_dict`` cannot name, so the state is read per param)."""
    steps = [group.get("step") for group in optimizer.param_groups]
    return [steps, *((p.detach(), dict(optimizer.state.get(p, {}))) for p in params)]


def _same(twins: list[tuple[Any, list[Tensor]]]) -> None:
    (stored, stored_params), (passed, passed_params) = twins
    assert_bitwise_equal(_values(stored, stored_params), _values(passed, passed_params))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, "mixed"], ids=str)
def test_cached_steps_run_on_the_stored_lists(name: str, dtype: object) -> None:
    twins = list(_twins(name, MIXED if dtype == "mixed" else torch.float32))
    for optimizer, params in twins:
        run_steps(optimizer, params, range(3))
    (stored, stored_params), (passed, passed_params) = twins
    stored.zero_grad()
    passed.zero_grad()
    loss_of(stored_params, 3).backward()
    loss_of(passed_params, 3).backward()
    buckets = 2 if dtype == "mixed" else 1
    op = f"amp_fused_ops::{OPTIMIZERS[name][1]}"
    plan_ops = _calls(stored.step)
    # One gather per group, then one step per bucket of each group; no list is passed.
    assert plan_ops.count("amp_fused_ops::multi_tensor_plan_gather") == 2
    assert plan_ops.count(f"{op}_plan") == 2 * buckets
    assert op not in plan_ops
    assert op in _calls(passed.step)
    _same(twins)


def test_a_dispatch_mode_gets_the_lists() -> None:
    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    (optimizer, params), _ = _twins()
    run_steps(optimizer, params, range(2))
    assert plans_available()
    with Seen() as seen:
        assert not plans_available()
        run_steps(optimizer, params, range(2, 3))
    # A mode sees every tensor the step writes: the step passed its lists.
    assert "amp_fused_ops.multi_tensor_adam.default" in seen.names
    assert not any("plan" in name for name in seen.names)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "change",
    ["grad_lost", "grad_gained", "dtype", "param_replaced", "state_replaced", "load_state_dict"],
)
def test_a_change_is_seen_as_by_the_passed_lists(name: str, change: str) -> None:
    twins = list(_twins(name))
    for optimizer, params in twins:
        run_steps(optimizer, params, range(3))
        active: tuple[int, ...] = (0, 1, 2, 4, 5, 6)
        if change == "grad_lost":
            active = (0, 1, 2, 4, 6)  # the second group's second param: no gradient now
        elif change == "grad_gained":
            active = (0, 1, 2, 3, 4, 5, 6)  # the first group's last param gets one
        elif change == "dtype":
            params[5].data = params[5].data.to(BF16)
        elif change == "param_replaced":
            fresh = torch.nn.Parameter(torch.full_like(params[1], 0.5))
            params[1] = optimizer.param_groups[0]["params"][1] = fresh
        elif change == "state_replaced":
            state = optimizer.state[params[0]]
            key = next(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0)
            state[key] = torch.full_like(state[key], 0.25)
        elif change == "load_state_dict":
            saved = optimizer.state_dict()
            state = saved["state"][0]
            key = next(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0)
            state[key] = state[key] * 4
            optimizer.load_state_dict(saved)
        run_steps(optimizer, params, range(3, 5), active)
    _same(twins)


def _planned_with_gradients(name: str) -> tuple[Any, list[Tensor]]:
    """An optimizer whose groups step on stored lists, its params with the next gradients."""
    (optimizer, params), _ = _twins(name)
    run_steps(optimizer, params, range(3))
    optimizer.zero_grad()
    loss_of(params, 3).backward()
    return optimizer, params


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_that_does_not_gather_releases_the_other_groups_gradients(name: str) -> None:
    optimizer, params = _planned_with_gradients(name)
    first_group_grad = weakref.ref(params[0].grad)
    params[5].grad = None  # the second group no longer matches its plan
    optimizer.step()  # the first group gathered, then the step passed lists
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert first_group_grad() is None, "the kernels still hold a gradient of the first group"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_kernels_release_the_gradients_after_the_step(name: str) -> None:
    (optimizer, params), _ = _twins(name)
    run_steps(optimizer, params, range(3))
    grads = [weakref.ref(p.grad) for p in params if p.grad is not None]
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert all(g() is None for g in grads)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_kernels_release_params_and_state_with_the_optimizer(name: str) -> None:
    (optimizer, params), _ = _twins(name)
    run_steps(optimizer, params, range(3))
    assert all(plan.lists is not None for plan in optimizer._plans.values())
    state = next(iter(optimizer.state[params[0]].values()))
    held = [weakref.ref(params[0]), weakref.ref(state)]
    del state
    del optimizer, params
    gc.collect()
    assert [ref() for ref in held] == [None, None]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_sparse_gradient_in_a_later_group_leaves_every_group_unstepped(name: str) -> None:
    optimizer, params = _planned_with_gradients(name)
    first = len(GROUP_SHAPES[0])
    params[first].grad = params[first].grad.to_sparse()
    before = snapshot(optimizer, params)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()
    assert_bitwise_equal(snapshot(optimizer, params), before)


# --- the ops themselves -------------------------------------------------------------------


def _plan(params: list[Tensor]) -> StepPlanLists:
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    lists = StepPlanLists.create(params, [0] * len(params), state)
    assert lists is not None
    return lists


def test_gather_reports_a_plan_the_kernels_do_not_hold() -> None:
    device_tensor = torch.empty(0, dtype=torch.int32)
    assert OPS.multi_tensor_plan_gather(device_tensor, -5) is False


def test_a_step_without_a_gather_is_refused() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    lists = _plan(params)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="holds no gradients; call multi_tensor_plan_gather"):
        OPS.multi_tensor_adam_plan(2048, flag, lists.handle, 0, 1e-3, 0.9, 0.999, 1e-8, 1,
                                   1, 1, 0.0)  # fmt: skip
    params[0].grad = torch.ones(3)
    assert lists.gather()
    with pytest.raises(ValueError, match="has 1 buckets, got bucket 1"):
        OPS.multi_tensor_adam_plan(2048, flag, lists.handle, 1, 1e-3, 0.9, 0.999, 1e-8, 1,
                                   1, 1, 0.0)  # fmt: skip


@pytest.mark.parametrize(
    ("buckets", "state", "message"),
    [
        ([0], 2, "2 params but 1 bucket indexes"),
        ([1, 0], 4, "bucket indexes must count up from 0"),
        ([0, 0], 3, "need 4 state tensors, got 3"),
    ],
)
def test_plan_set_refuses_inconsistent_lists(buckets: list[int], state: int, message: str) -> None:
    params = [torch.ones(2), torch.ones(2)]
    device_tensor = torch.empty(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        OPS.multi_tensor_plan_set(device_tensor, 10**9, params, buckets,
                                  [torch.zeros(2)] * state, 2)  # fmt: skip


def test_the_plan_ops_refuse_to_be_traced() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="runs eagerly only"):
        OPS.multi_tensor_plan_gather(mode.from_tensor(torch.empty(0, dtype=torch.int32)), 1)


@pytest.mark.parametrize("stored", [True, False])
def test_a_step_checks_the_state_once(stored: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from amp_optimizers._step_plan import StateSnapshot

    (optimizer, params), _ = _twins()
    optimizer._stores_step_plans = stored
    run_steps(optimizer, params, range(2))
    checks = []
    matches = StateSnapshot.matches
    monkeypatch.setattr(
        StateSnapshot, "matches", lambda self, state: checks.append(1) or matches(self, state)
    )
    run_steps(optimizer, params, range(2, 3))  # on stored lists (or passed ones)
    run_steps(optimizer, params, range(3, 4), (0, 1, 2, 4, 6))  # a gradient lost: lists passed
    assert len(checks) == 2
