"""LR schedulers built before or after ``amp.initialize``: no spurious torch warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES

from _amp_core_helpers import MasterAdam, batch, tiny_mlp
from amp_core import amp


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1.0)
    return MasterAdam(params, lr=1.0)  # the fused master-weight path at O2


# The same with amp_optimizers.FusedAdam at O2 (another package):
# tests/integration/test_lr_scheduler_order_fused_adam.py.
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("built", ["before_initialize", "after_initialize"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize(
    "opt_level, kind",
    [("O0", "sgd"), ("O1", "sgd"), ("O2", "sgd"), ("O3", "sgd"), ("O2", "master_adam")],
    ids=["O0-sgd", "O1-sgd", "O2-sgd", "O3-sgd", "O2-master_adam"],
)
def test_scheduler_steps_without_warnings_and_skipped_steps_stay_skipped(
    opt_level, kind, half, built
):
    model = tiny_mlp(0)
    opt = _optimizer(kind, model.parameters())
    if built == "before_initialize":  # the usual order of Apex scripts
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)
    if built == "after_initialize":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    poisoned = opt_level != "O0"  # a first step skipped for overflow (O0 does not check)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        loss = F.mse_loss(model(x).float(), y)
        if poisoned and step == 0:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
        moved = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert moved == (not (poisoned and step == 0))
    assert opt.param_groups[0]["lr"] == 0.125
    assert amp.skipped_steps(opt) == (1 if poisoned else 0)


@pytest.mark.parametrize("built", ["before_initialize", "after_initialize"])
def test_scheduler_stepped_before_the_optimizer_still_warns(built):
    model = tiny_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if built == "before_initialize":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    if built == "after_initialize":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()  # the wrong order: torch's own warning
    assert [str(w.message) for w in caught if "before `optimizer.step()`" in str(w.message)]
