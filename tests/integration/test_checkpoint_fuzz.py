"""Checkpoint fuzzing: the state dicts of amp and of both FP16_Optimizers, with each field set
to a wrong type, 0, a negative number, inf, nan, removed, or joined by an unknown one.

Every load either restores the state exactly (``state_dict()`` then returns what was loaded)
or raises a clear error (a TypeError / ValueError / KeyError / RuntimeError that names the
field) and leaves every object as it was: never half-loaded.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_core import amp

MISSING = object()
MUTATIONS: list[tuple[str, Any]] = [
    ("str", "x"),
    ("None", None),
    ("list", [1.0]),
    ("zero", 0),
    ("negative", -1),
    ("inf", float("inf")),
    ("nan", float("nan")),
    ("missing", MISSING),
]
ERRORS = (TypeError, ValueError, KeyError, RuntimeError)


def same(a: Any, b: Any) -> bool:
    """Deep equality of state dicts: tensors bitwise, floats with nan == nan."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def scalar_paths(state: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of every field below ``state`` (dict keys, and list entries of masters)."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield (*prefix, key)
            if key not in ("optimizer_state_dict",):  # the wrapped optimizer's own format
                yield from scalar_paths(value, (*prefix, key))
    elif isinstance(state, list):
        for i, value in enumerate(state):
            yield (*prefix, i)
            yield from scalar_paths(value, (*prefix, i))


def mutated(state: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(state)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if value is MISSING:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def with_extra(state: Any, path: tuple[Any, ...]) -> Any:
    out = copy.deepcopy(state)
    parent = out
    for key in path:
        parent = parent[key]
    parent["bogus_field"] = 1
    return out


class Target:
    """Something to load into: its observable state, and a load."""

    def __init__(
        self,
        snapshot: Callable[[], Any],
        load: Callable[[Any], None],
        state_dict: Callable[[], Any],
    ) -> None:
        self.snapshot, self.load, self.state_dict = snapshot, load, state_dict


def fuzz(source: Any, target: Target) -> list[str]:
    """Load every mutation of ``source`` into ``target``; return what went wrong."""
    problems = []
    cases: list[tuple[str, Any, str]] = []
    for path in scalar_paths(source):
        name = [str(k) for k in path if isinstance(k, str)][-1]  # a list entry: its list
        for label, value in MUTATIONS:
            cases.append((f"{path} -> {label}", mutated(source, path, value), name))
    for path in [()] + [p for p in scalar_paths(source) if _is_dict(source, p)]:
        if path and path[-1] == "optimizer_state_dict":
            continue
        cases.append((f"{path} + extra key", with_extra(source, path), "bogus_field"))
    cases.append(("the valid checkpoint", copy.deepcopy(source), ""))

    for label, state, name in cases:
        before = copy.deepcopy(target.snapshot())
        try:
            target.load(copy.deepcopy(state))
        except ERRORS as err:
            if name and name not in str(err):
                problems.append(f"{label}: the error does not name {name!r}: {err}")
            if not same(target.snapshot(), before):
                problems.append(f"{label}: raised {type(err).__name__} but changed the state")
            continue
        except Exception as err:  # any other error is the finding
            problems.append(f"{label}: unclear error {type(err).__name__}: {err}")
            continue
        if not same(target.state_dict(), state):
            problems.append(f"{label}: loaded, but state_dict() differs from what was loaded")
    return problems


def _is_dict(state: Any, path: tuple[Any, ...]) -> bool:
    for key in path:
        state = state[key]
    return isinstance(state, dict)


def tiny(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def batch(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g).to(dtype), torch.randn(8, 3, generator=g)


# --------------------------------------------------------------------------------------- amp


def _amp_run(train: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = amp.initialize(
        tiny(),
        torch.optim.SGD(tiny().parameters(), lr=0.1),
        opt_level="O1",
        half_dtype=torch.float16,
        num_losses=2,
        verbosity=0,
    )
    for step in range(5 if train else 0):
        for loss_id in (0, 1):
            opt.zero_grad()
            x, y = batch(step)
            loss = F.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
            opt.step()
    return model, opt


def test_amp_load_state_dict_fuzz() -> None:
    model, opt = _amp_run(train=True)
    source = amp.state_dict()
    assert source["loss_scaler0"] != {"loss_scale": 65536.0, "unskipped": 0}
    del model, opt
    gc.collect()
    _model, _opt = _amp_run(train=False)  # as in a new process (kept alive: a live call)
    target = Target(amp.state_dict, amp.load_state_dict, amp.state_dict)
    assert fuzz(source, target) == []


# --------------------------------------------------------------------- legacy FP16_Optimizer


def _legacy(dynamic: bool, train: bool) -> Any:
    from amp_legacy_fp16 import FP16_Optimizer

    model = tiny(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        opt = FP16_Optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            static_loss_scale=8.0,
            dynamic_loss_scale=dynamic,
            dynamic_loss_args={"init_scale": 2.0**16} if dynamic else None,
            verbose=False,
        )
    for step in range(5 if train else 0):
        opt.zero_grad()
        x, y = batch(step, torch.float16)
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        opt.backward(loss)
        opt.step()
    return model, opt


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_legacy_fp16_optimizer_load_state_dict_fuzz(dynamic: bool) -> None:
    _, source_opt = _legacy(dynamic, train=True)
    source = copy.deepcopy(source_opt.state_dict())
    model, opt = _legacy(dynamic, train=False)

    def snapshot() -> Any:
        return [opt.state_dict(), [p.detach().clone() for p in model.parameters()]]

    assert fuzz(source, Target(snapshot, opt.load_state_dict, opt.state_dict)) == []


# --------------------------------------------------------- amp_optimizers' FP16_Optimizer


def _fused(dynamic: bool, train: bool) -> Any:
    from amp_optimizers import FP16_Optimizer, FusedAdam

    model = tiny(torch.float16)
    opt = FP16_Optimizer(
        FusedAdam(model.parameters(), lr=1e-3),
        static_loss_scale=8.0,
        dynamic_loss_scale=dynamic,
        verbose=False,
    )
    for step in range(5 if train else 0):
        opt.zero_grad()
        x, y = batch(step, torch.float16)
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        opt.backward(loss)
        opt.step()
    return model, opt


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_fused_fp16_optimizer_load_state_dict_fuzz(dynamic: bool) -> None:
    _, source_opt = _fused(dynamic, train=True)
    source = copy.deepcopy(source_opt.state_dict())
    model, opt = _fused(dynamic, train=False)

    def snapshot() -> Any:
        return [opt.state_dict(), [p.detach().clone() for p in model.parameters()]]

    assert fuzz(source, Target(snapshot, opt.load_state_dict, opt.state_dict)) == []
