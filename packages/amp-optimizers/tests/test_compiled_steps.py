"""The fused optimizers under torch.compile: one graph, no graph break, the eager result.

Every ``amp_C`` op is a dispatcher op with a fake kernel (amp_fused_ops' op registry), so
Dynamo traces a step straight into the op calls. ``FusedMixedPrecisionLamb`` keeps its skip
decision, ``lr`` and ``step`` on the device, so its step is one graph as well.
"""

from __future__ import annotations

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
