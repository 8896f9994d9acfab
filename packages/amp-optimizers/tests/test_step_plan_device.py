"""FusedAdam's device path (``capturable``, master weights, a ``GradScaler``) on cached plans.

The device path's layout (each group's params with a gradient, by device and dtype, with their
moments and masters) is cached as the plain path's is, in a plan of its own kind. Each test
runs the same steps twice, with the cached layout and with the lists gathered at every step
(``_plans_device_path`` switched off: the code before the cache), and requires the same bits,
across the changes a cached layout must notice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from _amp_optimizers_helpers import (
    ACTIVE,
    assert_bitwise_equal,
    loss_of,
    make_params,
    two_groups,
)
from amp_optimizers import FusedAdam

BF16 = torch.bfloat16
MIXED = [torch.float32, BF16, torch.float32, torch.float32, BF16, torch.float32, BF16, BF16]

# name -> (param dtypes, FusedAdam's options, steps through a GradScaler)
CONFIGS: dict[str, tuple[Any, dict[str, Any], bool]] = {
    "capturable": (torch.float32, {"capturable": True}, False),
    # bfloat16 params without masters: a float32 copy per step, stepped and written back.
    "capturable-mixed": (MIXED, {"capturable": True}, False),
    "master-weights": (MIXED, {"master_weights": True}, False),
    # GradScaler leaves the unscaling to FusedAdam when it is capturable or has master weights.
    "grad-scaler": (torch.float32, {"capturable": True}, True),
    "grad-scaler-master-weights": (MIXED, {"master_weights": True}, True),
}
PLAIN: tuple[Any, dict[str, Any], bool] = (torch.float32, {}, False)


class Run:
    """One FusedAdam of two groups and its params, stepped as a training loop would."""

    def __init__(self, config: str, cached: bool) -> None:
        dtypes, options, self.scaled = PLAIN if config == "plain" else CONFIGS[config]
        self.params = make_params(dtype=dtypes)
        self.optimizer = FusedAdam(
            two_groups(self.params, {"weight_decay": 0.0}), lr=1e-2, weight_decay=0.1, **options
        )
        self.optimizer._plans_device_path = cached
        self.scaler = torch.amp.GradScaler("cpu", init_scale=64.0) if self.scaled else None

    def step(self, number: int, active: tuple[int, ...] = ACTIVE, poison: int = -1) -> None:
        """Backward of the loss of step ``number`` over ``active`` params, then the step;
        ``poison``: the param whose gradient gets an inf."""
        self.optimizer.zero_grad()
        loss = loss_of(self.params, number, active)
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        if poison >= 0:
            grad = self.params[poison].grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def values(self) -> list[object]:
        steps = [group.get("step") for group in self.optimizer.param_groups]
        return [steps, *((p.detach(), dict(self.optimizer.state.get(p, {}))) for p in self.params)]


def _twins(config: str) -> Iterator[Run]:
    for cached in (True, False):
        yield Run(config, cached)


def _same(twins: list[Run]) -> None:
    cached, gathered = twins
    assert_bitwise_equal(cached.values(), gathered.values())
    if cached.scaler is not None:
        assert cached.scaler.get_scale() == gathered.scaler.get_scale()  # type: ignore[union-attr]


def _both(twins: list[Run], action: Callable[[Run], None]) -> None:
    for run in twins:
        action(run)
    _same(twins)


@pytest.mark.parametrize("config", CONFIGS)
def test_layout_is_cached_across_steps(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    twins = list(_twins(config))
    cached = twins[0].optimizer
    built: list[str] = []
    build = cached._build_plan

    def counting_build(*args: Any, **kwargs: Any) -> Any:
        plan = build(*args, **kwargs)
        built.append(plan.kind)
        return plan

    monkeypatch.setattr(cached, "_build_plan", counting_build)
    for number in range(4):
        _both(twins, lambda run, n=number: run.step(n))
    # One plan per group, built at the first step and kept: its columns are the device path's.
    assert built == ["device", "device"]
    assert {plan.kind for plan in cached._plans.values()} == {"device"}
    assert len(cached.param_groups[0]["params"]) == 4  # the params moved nowhere
    assert all(isinstance(group["step"], Tensor) for group in cached.param_groups)


@pytest.mark.parametrize("config", CONFIGS)
def test_changes_between_steps_rebuild_the_layout(config: str) -> None:
    twins = list(_twins(config))
    _both(twins, lambda run: run.step(0))
    # A param loses its gradient, then gets it back.
    _both(twins, lambda run: run.step(1, active=(0, 2, 4, 5, 6)))
    _both(twins, lambda run: run.step(2))
    # A state tensor replaced, and a whole per-param state cleared (re-created at zero).
    for run in twins:
        p = run.params[0]
        run.optimizer.state[p]["exp_avg"] = run.optimizer.state[p]["exp_avg"] * 0.5
        run.optimizer.state[run.params[5]].clear()
    _both(twins, lambda run: run.step(3))
    # load_state_dict of the optimizer's own state.
    for run in twins:
        run.optimizer.load_state_dict(run.optimizer.state_dict())
    _both(twins, lambda run: run.step(4))
    # A param replaced in its group by a new tensor.
    for run in twins:
        fresh = torch.nn.Parameter(run.params[1].detach().clone() * 2)
        run.optimizer.param_groups[0]["params"][1] = fresh
        run.params[1] = fresh
    _both(twins, lambda run: run.step(5))
    _both(twins, lambda run: run.step(6))


@pytest.mark.parametrize("config", CONFIGS)
def test_an_inf_in_either_group_skips_the_whole_step(config: str) -> None:
    twins = list(_twins(config))
    _both(twins, lambda run: run.step(0))
    for poison in (1, 6):  # a param of the first group, then of the second
        before = [p.detach().clone() for p in twins[0].params]
        _both(twins, lambda run, p=poison: run.step(1, poison=p))
        assert_bitwise_equal([p.detach() for p in twins[0].params], before)
    _both(twins, lambda run: run.step(2))


def test_plain_and_device_steps_alternate() -> None:
    """A loss scale handed to the step on some steps only (``grad_scale`` and ``found_inf``, as
    a GradScaler sets them): the group's plan follows the path of each step."""
    twins = [Run("plain", cached) for cached in (True, False)]
    for number in range(6):
        for run in twins:
            run.optimizer.zero_grad()
            scale = 4.0 if number % 2 else 1.0
            (loss_of(run.params, number) * scale).backward()
            if number % 2:
                run.optimizer.grad_scale = torch.tensor(scale)
                run.optimizer.found_inf = torch.zeros(())
            run.optimizer.step()
            for name in ("grad_scale", "found_inf"):
                run.optimizer.__dict__.pop(name, None)
        _same(twins)
        kinds = {plan.kind for plan in twins[0].optimizer._plans.values()}
        assert kinds == ({"device"} if number % 2 else {"plain"})


def test_a_sparse_gradient_is_refused_on_the_cached_layout() -> None:
    run = Run("capturable", cached=True)
    run.step(0)
    run.optimizer.zero_grad()
    loss_of(run.params, 1).backward()
    run.params[0].grad = run.params[0].grad.to_sparse()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="sparse"):
        run.optimizer.step()


def _amp_o2_run(cached: bool) -> dict[str, object]:
    """Six amp O2 steps of a small model with FusedAdam (bfloat16 model, float32 masters): one
    skipped for an inf gradient, one after clipping the masters' gradients (amp then unscales
    them into the masters' ``.grad``, which the cached layout does not read)."""
    from amp_core import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    optimizer._plans_device_path = cached
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", half_dtype=BF16, verbosity=0
    )
    kinds = []
    for number in range(6):
        gen = torch.Generator().manual_seed(100 + number)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        if number == 2:
            model[0].weight.grad.view(-1)[0] = float("inf")
        if number == 4:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        kinds.append(sorted({plan.kind for plan in optimizer._plans.values()}))
    return {
        "model": [p.detach().clone() for p in model.parameters()],
        "masters": [p.detach().clone() for p in amp.master_params(optimizer)],
        "state": [dict(s) for s in optimizer.state.values()],
        "steps": [group["step"] for group in optimizer.param_groups],
        "skipped": amp.skipped_steps(optimizer),
        "kinds": kinds,
    }


def test_amp_o2_steps_on_the_cached_layout() -> None:
    cached, gathered = _amp_o2_run(True), _amp_o2_run(False)
    assert cached["skipped"] == gathered["skipped"] == 1
    # amp's fused master step took the cached layout; the step after clipping gathered its
    # lists (the masters held the gradients) and left the layout as it was.
    assert cached["kinds"] == [["device"]] * 6
    assert gathered["kinds"] == [[]] * 6
    for key in ("model", "masters", "state", "steps"):
        assert_bitwise_equal(cached[key], gathered[key], key)
