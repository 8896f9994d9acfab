"""The fused optimizers under torch.compile: one graph, no graph break, the eager result.

Every ``amp_C`` op is a dispatcher op with a fake kernel (amp_fused_ops' op registry), so
Dynamo traces a step straight into the op calls. ``FusedMixedPrecisionLamb`` keeps its skip
decision, ``lr`` and ``step`` on the device, so its step is one graph as well.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from amp_optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

CASES: dict[str, tuple[Callable[[list[Tensor]], torch.optim.Optimizer], torch.dtype]] = {
    "adam": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), torch.float32),
    "adam_l2": (
        lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.1),
        torch.float32,
    ),
    "adam_no_bias_correction": (
        lambda ps: FusedAdam(ps, lr=1e-2, bias_correction=False),
        torch.float32,
    ),
    "adam_capturable": (lambda ps: FusedAdam(ps, lr=1e-2, capturable=True), torch.float32),
    "adam_capturable_master_bf16": (
        lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
        torch.bfloat16,
    ),
    "adam_bf16_stochastic_round": (
        lambda ps: FusedAdam(ps, lr=1e-2, bf16_stochastic_round=True, stochastic_round_seed=7),
        torch.bfloat16,
    ),
    "sgd_bf16_stochastic_round": (
        lambda ps: FusedSGD(
            ps, lr=1e-2, momentum=0.9, bf16_stochastic_round=True, stochastic_round_seed=7
        ),
        torch.bfloat16,
    ),
    "sgd_nesterov": (
        lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
        torch.float32,
    ),
    "lamb": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01), torch.float32),
    "novograd": (lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01), torch.float32),
    "adagrad": (lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.1), torch.float32),
    "mixed_precision_lamb": (
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, max_grad_norm=0.5),
        torch.float32,
    ),
    "mixed_precision_lamb_bf16_masters": (
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=torch.bfloat16),
        torch.bfloat16,
    ),
}
SLOW_COMPILES = {name for name in CASES if name not in ("adam", "adam_capturable")}
# NovoGrad's first-step gradient norms are computed with ATen ops around the kernel, which the
# compiled graph fuses into its own loop: one float32 rounding apart, not bitwise.
NOT_BITWISE = {"novograd": {"rtol": 2e-7, "atol": 0.0}}


def _params(dtype: torch.dtype) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 4), (7,), (3, 5)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params: list[Tensor], steps: int) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_is_one_graph_without_breaks(case: str) -> None:
    make, dtype = CASES[case]
    params = _params(dtype)
    for p, g in zip(params, _grads(params, 1)[0], strict=True):
        p.grad = g
    optimizer = make(params)
    optimizer.step()  # the state exists: the traced step is the steady one
    explained = torch._dynamo.explain(optimizer.step)()
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_COMPILES else c for c in CASES],
)
def test_compiled_steps_equal_eager_steps(case: str) -> None:
    make, dtype = CASES[case]
    eager_params, compiled_params = _params(dtype), _params(dtype)
    eager, compiled = make(eager_params), make(compiled_params)
    step = torch.compile(compiled.step, fullgraph=True)
    graphs = []
    for grads in _grads(eager_params, 5):
        for p, q, g in zip(eager_params, compiled_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        eager.step()
        step()
        graphs.append(counters["stats"]["unique_graphs"])
    # The first step creates the state, the second compiles the steady step; after that the
    # changing step count and state are data of that graph, never a reason to recompile.
    assert graphs[1:] == [graphs[1]] * 4, graphs
    for group, other in zip(eager.param_groups, compiled.param_groups, strict=True):
        assert float(other.get("step", 0)) == float(group.get("step", 0))
    tolerance = NOT_BITWISE.get(case, {"rtol": 0.0, "atol": 0.0})
    for p, q in zip(eager_params, compiled_params, strict=True):
        torch.testing.assert_close(q, p, **tolerance)
        for key, value in eager.state[p].items():
            other = compiled.state[q][key]
            if isinstance(value, Tensor):
                torch.testing.assert_close(other, value, **tolerance, msg=key)
            else:
                assert value == other, key
    for group, other in zip(eager.param_groups, compiled.param_groups, strict=True):
        for key, value in group.items():
            if isinstance(value, Tensor):  # a device lr or step count
                torch.testing.assert_close(other[key], value, rtol=0, atol=0, msg=key)
    # The trace writes torch.optim's capturable flag into the groups: never saved.
    saved, eager_saved = compiled.state_dict(), eager.state_dict()
    for group, other in zip(eager_saved["param_groups"], saved["param_groups"], strict=True):
        assert other.keys() == group.keys()


def test_a_state_dict_saved_after_compiled_steps_loads_into_torch_adamw() -> None:
    """The documented interop (FusedAdam's state dict steps torch.optim.AdamW) holds after
    compiled steps too: the group carries no capturable=True that AdamW would refuse on CPU."""
    params, twins = _params(torch.float32), _params(torch.float32)
    fused = FusedAdam(params, lr=1e-2)
    step = torch.compile(fused.step, fullgraph=True)
    grads = _grads(params, 3)
    for gs in grads[:2]:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        step()
    saved = copy.deepcopy(fused.state_dict())  # a checkpoint: no tensor shared with fused
    assert all("capturable" not in group for group in saved["param_groups"])
    adamw = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0)
    with torch.no_grad():
        for twin, p in zip(twins, params, strict=True):
            twin.copy_(p)
    adamw.load_state_dict(saved)
    for p, twin, g in zip(params, twins, grads[2], strict=True):
        p.grad, twin.grad = g.clone(), g.clone()
    fused.step()
    adamw.step()
    for p, twin in zip(params, twins, strict=True):
        torch.testing.assert_close(twin, p, rtol=1e-6, atol=1e-7)


LR_CASES: dict[str, Callable[[list[Tensor], Tensor], torch.optim.Optimizer]] = {
    "adam": lambda ps, lr: FusedAdam(ps, lr=lr, weight_decay=0.1),
    "sgd": lambda ps, lr: FusedSGD(ps, lr=lr, momentum=0.9, weight_decay=0.1),
    "lamb": lambda ps, lr: FusedLAMB(ps, lr=lr, weight_decay=0.01),
    "adagrad": lambda ps, lr: FusedAdagrad(ps, lr=lr, weight_decay=0.1),
    "novograd": lambda ps, lr: FusedNovoGrad(ps, lr=lr, weight_decay=0.01),
}


@pytest.mark.parametrize(
    "case", [c if c == "sgd" else pytest.param(c, marks=pytest.mark.slow) for c in LR_CASES]
)
def test_a_tensor_lr_changed_between_compiled_steps_recompiles_nothing(case: str) -> None:
    """A tensor lr (torch.optim's advice under torch.compile) is data of the compiled step: a
    scheduler's in-place change takes effect without a recompile, as in eager mode."""
    make = LR_CASES[case]
    counters.clear()
    eager_params, compiled_params = _params(torch.float32), _params(torch.float32)
    eager = make(eager_params, torch.tensor(1e-2))
    compiled = make(compiled_params, torch.tensor(1e-2))
    step = torch.compile(compiled.step, fullgraph=True)
    graphs = []
    for grads in _grads(eager_params, 5):
        for p, q, g in zip(eager_params, compiled_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        eager.step()
        step()
        graphs.append(counters["stats"]["unique_graphs"])
        for optimizer in (eager, compiled):  # what an LR scheduler does to a tensor lr
            optimizer.param_groups[0]["lr"].mul_(0.5)
    assert graphs[1:] == [graphs[1]] * 4, graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    tolerance = NOT_BITWISE.get(case, {"rtol": 0.0, "atol": 0.0})
    for p, q in zip(eager_params, compiled_params, strict=True):
        torch.testing.assert_close(q, p, **tolerance)
