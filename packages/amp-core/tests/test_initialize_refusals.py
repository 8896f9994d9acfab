"""A refused ``amp.initialize`` changes nothing: every refusal comes before the first change.

For each kind of refusal: the models keep their dtypes, values and hooks, the optimizers their
methods and param groups, nothing gets an ``_amp_state``, the previous call stays current (its
O1 casting on), and the same model and optimizer then go through a call with fixed arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from _amp_core_helpers import tiny_mlp
from amp_core import amp


class RefusingSGD(torch.optim.SGD):
    """An optimizer that cannot step float32 master weights (as a stochastically rounding
    FusedAdam): it refuses in ``amp_check_initialize`` and again when asked to keep masters."""

    def amp_check_initialize(self, *, master_weights: bool, cast: torch.dtype | None) -> None:
        if master_weights:
            raise ValueError("RefusingSGD cannot step master weights; use O3")

    def amp_enable_fused_master_weights(
        self, fp32_sources: Mapping[torch.Tensor, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise ValueError("RefusingSGD cannot step master weights; use O3")

    def amp_disable_fused_master_weights(self) -> None:
        pass

    def amp_fused_master_step(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        raise AssertionError("never called")


class _Wrapper:
    """A LARC-like wrapper around a refusing optimizer."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim
        self.param_groups = optim.param_groups
        self.state = optim.state

    def step(self, closure: Any = None) -> Any:
        return self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)


Case = Callable[[nn.Module, torch.optim.Optimizer], Any]


def _initialize(model: nn.Module, optimizer: Any, **kwargs: Any) -> Any:
    return amp.initialize(model, optimizer, verbosity=0, **kwargs)


# (id, refused call, exception, match): one per kind of refusal of amp.initialize.
REFUSALS: list[tuple[str, Case, type[Exception], str]] = [
    ("models_type", lambda m, o: _initialize("model", o), TypeError, "models must be"),
    ("optimizers_type", lambda m, o: _initialize(m, [o, 1]), TypeError, "optimizers must be"),
    ("num_losses", lambda m, o: _initialize(m, o, num_losses=0), ValueError, "num_losses"),
    ("opt_level", lambda m, o: _initialize(m, o, opt_level="02"), RuntimeError, "letter O"),
    (
        "override_for_level",
        lambda m, o: _initialize(m, o, opt_level="O1", keep_batchnorm_fp32=True),
        RuntimeError,
        "keep_batchnorm_fp32 should be None",
    ),
    (
        "malformed_property",
        lambda m, o: _initialize(m, o, opt_level="O2", loss_scale="big"),
        ValueError,
        "loss_scale must be",
    ),
    (
        "cast_model_type",
        lambda m, o: _initialize(m, o, opt_level="O2", cast_model_type=True),
        ValueError,
        "cast_model_type must be",
    ),
    (
        "wrapped_model",
        lambda m, o: _initialize(nn.DataParallel(m), o, opt_level="O2"),
        RuntimeError,
        "Parallel wrappers should only be applied",
    ),
    (
        "optimizer_twice_in_the_list",
        lambda m, o: _initialize(m, [o, o], opt_level="O2"),
        RuntimeError,
        "appears twice",
    ),
    (
        "optimizer_refuses",
        lambda m, o: _initialize(m, RefusingSGD(m.parameters(), lr=0.1), opt_level="O2"),
        ValueError,
        "cannot step master weights",
    ),
    (
        "wrapped_optimizer_refuses",
        lambda m, o: _initialize(m, _Wrapper(RefusingSGD(m.parameters(), lr=0.1)), opt_level="O2"),
        ValueError,
        "cannot step master weights",
    ),
]


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    hooks = {
        name: len(getattr(module, name))
        for module in model.modules()
        for name in ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks")
    }
    return {
        "params": [(p, p.dtype, p.detach().clone()) for p in model.parameters()],
        "hooks": hooks,
        "amp_state": hasattr(model, "_amp_state") or hasattr(optimizer, "_amp_state"),
        "patched": sorted(k for k in ("step", "zero_grad") if k in optimizer.__dict__),
        "groups": [list(g["params"]) for g in optimizer.param_groups],
    }


def _same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["hooks"] == after["hooks"]
    assert before["amp_state"] is after["amp_state"] is False
    assert before["patched"] == after["patched"] == []
    assert all(
        a is b
        for ga, gb in zip(before["groups"], after["groups"], strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    for (p, dtype, value), (q, dtype_after, value_after) in zip(
        before["params"], after["params"], strict=True
    ):
        assert p is q and dtype == dtype_after and torch.equal(value, value_after)


@pytest.mark.parametrize(
    ("call", "error", "match"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_a_refused_initialize_changes_nothing(
    call: Case, error: type[Exception], match: str
) -> None:
    # A previous call is current, with its O1 casting on.
    first = tiny_mlp(seed=1)
    first, _ = amp.initialize(
        first, torch.optim.SGD(first.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    assert amp._amp_state.handle.is_active()

    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, optimizer)
    with pytest.raises(error, match=match):
        call(model, optimizer)
    _same(before, _snapshot(model, optimizer))
    assert amp._amp_state.handle.is_active()  # the previous call is still on
    assert amp._amp_state.opt_properties.opt_level.value == "O1"

    # The retry with fixed arguments, on the same model and optimizer.
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0
    )
    assert model[0].weight.dtype == torch.bfloat16
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def test_a_refusing_optimizer_is_accepted_where_it_can_step() -> None:
    model = tiny_mlp()
    optimizer = RefusingSGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O3", verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
