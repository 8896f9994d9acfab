"""An LR scheduler built before or after ``amp.initialize`` with ``amp_optimizers.FusedAdam`` at
O2 (the fused master-weight path of amp-core): no spurious torch warning, and a step skipped for
overflow stays skipped. amp-core's test_lr_scheduler_order.py checks the same with a torch
optimizer at every level.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES

from amp_core import amp
from amp_optimizers import FusedAdam


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g) * 0.5, torch.randn(8, 3, generator=g) * 0.5


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("built", ["before_initialize", "after_initialize"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_scheduler_steps_without_warnings_and_skipped_steps_stay_skipped(half, built):
    model = _mlp(0)
    opt = FusedAdam(model.parameters(), lr=1.0)
    if built == "before_initialize":  # the usual order of Apex scripts
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    if built == "after_initialize":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(step)
        loss = F.mse_loss(model(x).float(), y)
        if step == 0:  # a first step skipped for overflow
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
        moved = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert moved == (step != 0)
    assert opt.param_groups[0]["lr"] == 0.125
    assert amp.skipped_steps(opt) == 1
