"""FusedAdam's and FusedSGD's steps on stored lists under DDP, two Gloo ranks, against torch.

Each rank trains the same model on its own batches under torch's DistributedDataParallel with
two param groups (decay and no decay) and a frozen layer, three times per optimizer: the fused
one on the lists the compiled kernels hold (on its cached layout, for FusedAdam's device path:
``capturable=True``), the fused one passing its lists per step (gathered at every step), and
torch's (``AdamW``, ``SGD`` with momentum); one step drops a gradient on every rank (the plan
no longer matches, and that step passes its lists). The ranks must end bitwise equal to each
other, the two fused runs bitwise equal, and the fused optimizer within float32 rounding of
torch's (for Adam except the param whose gradient was dropped: AdamW counts its steps per
param, FusedAdam per group, as Apex's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from amp_test_support import gloo_world_results

from amp_fused_ops import StepPlanLists
from amp_optimizers import FusedAdam, FusedSGD

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

WORLD = 2
STEPS = 5
DROPPED_AT = 3  # the step whose gradient of the last bias is dropped on every rank


def _groups(model: torch.nn.Module) -> list[dict[str, object]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


# name -> (fused optimizer, torch optimizer, whether torch counts the dropped param alike)
OPTIMIZERS: dict[str, tuple[Callable[..., Any], Callable[..., Any], bool]] = {
    # AdamW counts its steps per param, FusedAdam per group (as Apex's): the dropped param's
    # bias correction differs afterwards.
    "adam": (
        lambda groups: FusedAdam(groups, lr=1e-2, weight_decay=0.05),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
        False,
    ),
    "sgd": (
        lambda groups: FusedSGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.05),
        lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.05),
        True,
    ),
    # The device path: the step count, lr and skip flag on the device, the layout cached.
    "adam-capturable": (
        lambda groups: FusedAdam(groups, lr=1e-2, weight_decay=0.05, capturable=True),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
        False,
    ),
}
# name -> the optimizer's switch to the lists passed (gathered) at every step
PER_STEP_LISTS = {
    "adam": "_stores_step_plans",
    "sgd": "_stores_step_plans",
    "adam-capturable": "_plans_device_path",
}


def _run(rank: int, name: str) -> dict[str, object]:
    from torch.nn.parallel import DistributedDataParallel

    make_fused, make_torch, _ = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(11, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip
    model[2].requires_grad_(False)  # frozen: in the groups, never a gradient
    passing, twin = copy.deepcopy(model), copy.deepcopy(model)
    fused = make_fused(_groups(model))
    fused_passing = make_fused(_groups(passing))
    setattr(fused_passing, PER_STEP_LISTS[name], False)
    runs = [
        (DistributedDataParallel(net), optimizer, net)
        for net, optimizer in (
            (model, fused),
            (passing, fused_passing),
            (twin, make_torch(_groups(twin))),
        )
    ]
    torch.manual_seed(100 + rank)  # each rank its own batches
    stored = []
    for step in range(STEPS):
        x = torch.randn(8, 11)
        for ddp, optimizer, net in runs:
            optimizer.zero_grad()
            ddp(x).square().mean().backward()
            if step == DROPPED_AT:
                net[4].bias.grad = None
            optimizer.step()
        stored.append([(plan.kind, plan.lists is not None) for plan in fused._plans.values()])
    return {
        key: torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        for key, net in (("stored", model), ("passed", passing), ("torch", twin))
    } | {"plans": stored}


def _worker(rank: int) -> dict[str, dict[str, object]]:
    return {name: _run(rank, name) for name in OPTIMIZERS}


@pytest.mark.skipif(
    StepPlanLists.create([torch.ones(1)], [0], [[torch.ones(1)]]) is None,
    reason="the step plans need the compiled CPU kernels",
)
def test_ranks_agree_and_match_torch() -> None:
    ranks = gloo_world_results(_worker, WORLD)
    for name, (_, _, counts_alike) in OPTIMIZERS.items():
        results = [rank[name] for rank in ranks]
        for result in results:
            # Both groups stepped on stored lists (the device path: on its cached layout, whose
            # lists are passed) at the last step.
            expected = ("device", False) if name == "adam-capturable" else ("plain", True)
            assert result["plans"][-1] == [expected, expected], name
            assert torch.equal(result["stored"], result["passed"]), name
            end = None if counts_alike else -3  # the last bias, at the end
            torch.testing.assert_close(
                result["stored"][:end], result["torch"][:end], rtol=1e-5, atol=1e-6
            )
        differ = int((results[0]["stored"] != results[1]["stored"]).sum())
        assert differ == 0, f"{name}: {differ} weights differ between the ranks"
