"""The fused optimizers leave torch's default random generator alone, as torch.optim's do.

A user who swaps ``torch.optim.SGD`` for ``FusedSGD`` with the same ``torch.manual_seed`` must
get the same data order and dropout masks: building and stepping an optimizer draws nothing.
Only stochastic rounding without a seed of its own draws, once (documented: one
``torch.randint`` when the first rounding group is added), and the draw is saved in
``state_dict()``, so a resumed run continues bitwise (``test_bf16_stochastic_round.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from amp_optimizers import (
    FP16_Optimizer,
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

BF16 = torch.bfloat16
Build = Callable[[list[Tensor]], object]

# Each builds an optimizer over params of the dtype it takes (float32 unless named).
BUILDS: dict[str, tuple[torch.dtype, Build]] = {
    "FusedAdam": (torch.float32, lambda ps: FusedAdam(ps, lr=1e-3)),
    "FusedAdam_capturable": (torch.float32, lambda ps: FusedAdam(ps, lr=1e-3, capturable=True)),
    "FusedAdam_master_weights": (BF16, lambda ps: FusedAdam(ps, lr=1e-3, master_weights=True)),
    "FusedSGD": (torch.float32, lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9)),
    "FusedLAMB": (torch.float32, lambda ps: FusedLAMB(ps, lr=1e-3)),
    "FusedNovoGrad": (torch.float32, lambda ps: FusedNovoGrad(ps, lr=1e-3)),
    "FusedAdagrad": (torch.float32, lambda ps: FusedAdagrad(ps, lr=1e-2)),
    "FusedMixedPrecisionLamb": (
        BF16,
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3, reduced_precision_dtype=BF16),
    ),
    "FP16_Optimizer(FusedAdam)": (
        torch.float16,
        lambda ps: FP16_Optimizer(FusedAdam(ps, lr=1e-3), static_loss_scale=1.0),
    ),
    # The option named, with a seed of its own: nothing to draw.
    "FusedAdam_sr_seeded": (
        BF16,
        lambda ps: FusedAdam(ps, lr=1e-3, bf16_stochastic_round=True, stochastic_round_seed=3),
    ),
    "FusedSGD_sr_seeded": (
        BF16,
        lambda ps: FusedSGD(ps, lr=0.1, bf16_stochastic_round=True, stochastic_round_seed=3),
    ),
    "FusedSGD_sr_off": (BF16, lambda ps: FusedSGD(ps, lr=0.1, bf16_stochastic_round=False)),
}


def _params(dtype: torch.dtype) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)  # not the default generator
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (5, 3)]


def _steps(optimizer: object, params: list[Tensor]) -> None:
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", BUILDS)
def test_building_and_stepping_draws_nothing(name: str) -> None:
    dtype, build = BUILDS[name]
    params = _params(dtype)
    torch.manual_seed(0)
    expected = torch.rand(3)

    torch.manual_seed(0)
    optimizer = build(params)
    _steps(optimizer, params)
    assert torch.equal(torch.rand(3), expected), f"{name} drew from the default generator"


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD], ids=lambda c: c.__name__)
def test_a_param_group_added_without_rounding_draws_nothing(cls: type) -> None:
    optimizer = cls(_params(torch.float32), lr=0.1)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    optimizer.add_param_group({"params": _params(BF16)})
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD], ids=lambda c: c.__name__)
def test_the_default_rounding_seed_is_one_documented_draw(cls: type) -> None:
    """Without a seed, the optimizer draws one ``torch.randint(0, 2**62, (1,))`` when its first
    rounding group is added (at construction or later), and that seed goes into every group
    that rounds without a seed of its own and into ``state_dict()``."""
    torch.manual_seed(7)
    expected = int(torch.randint(0, 2**62, (1,)).item())
    after = torch.rand(1)

    torch.manual_seed(7)
    optimizer = cls([{"params": _params(torch.float32)}], lr=0.1)  # no rounding: no draw
    optimizer.add_param_group({"params": _params(BF16), "bf16_stochastic_round": True})
    optimizer.add_param_group(
        {"params": _params(BF16), "bf16_stochastic_round": True, "stochastic_round_seed": 5}
    )
    optimizer.add_param_group({"params": _params(BF16), "bf16_stochastic_round": True})
    assert torch.equal(torch.rand(1), after)  # exactly one draw
    seeds = [g["stochastic_round_seed"] for g in optimizer.state_dict()["param_groups"]]
    assert seeds[1:] == [expected, 5, expected]
