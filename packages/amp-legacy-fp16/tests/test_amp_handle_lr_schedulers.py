"""The ``amp.init()`` handle with PyTorch's LR schedulers: an overflowing step is skipped.

A scheduler wraps ``optimizer.step`` on the instance; it may be built before or after the handle
first touches the optimizer (``handle.scale_loss``) or wraps it (``handle.wrap_optimizer``, the
scheduler then being built on the inner optimizer). Each run is compared with plain fp32
PyTorch taking the same steps (the skipped one left out) under the same scheduler.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES
from torch.optim import lr_scheduler

from _legacy_helpers import batch
from amp_legacy_fp16 import amp

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]] = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.8**epoch),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=4),
}

# (how the loss is scaled, when the scheduler is built)
WAYS = [
    pytest.param("scale_loss", "before", id="scale_loss-scheduler_first"),
    pytest.param("scale_loss", "after", id="scale_loss-scheduler_after_first_step"),
    pytest.param("wrap_optimizer", "before", id="wrap_optimizer-scheduler_first"),
    pytest.param("wrap_optimizer", "after", id="wrap_optimizer-scheduler_after_wrap"),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class _Reference:
    """Plain fp32 PyTorch: the same model, optimizer and scheduler, no amp."""

    def __init__(self, model: torch.nn.Module, make_scheduler: Callable) -> None:
        self.model = copy.deepcopy(model).float()
        self.opt = _sgd(self.model)
        self.make_scheduler = make_scheduler
        self.scheduler: lr_scheduler.LRScheduler | None = None

    def build_scheduler(self) -> None:
        self.scheduler = self.make_scheduler(self.opt)

    def iteration(self, x: torch.Tensor, y: torch.Tensor, *, step: bool) -> None:
        with warnings.catch_warnings():
            # torch warns here when the skipped step is the first: that is the reference's
            # doing (it leaves the step out), not amp's.
            warnings.simplefilter("ignore", UserWarning)
            if step:
                self.opt.zero_grad()
                F.mse_loss(self.model(x), y).backward()
                self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("scheduler_name", list(SCHEDULERS))
@pytest.mark.parametrize(("api", "built"), WAYS)
def test_overflow_is_skipped_under_an_lr_scheduler(half, scheduler_name, api, built):
    make_scheduler = SCHEDULERS[scheduler_name]
    model = _model()
    ref = _Reference(model, make_scheduler)
    handle = amp.init(half_dtype=half)
    inner = _sgd(model)
    scheduler = None
    with warnings.catch_warnings():
        # No warning from torch (a scheduler stepped "before optimizer.step()", or a step
        # "overridden after learning rate scheduler initialization"), nor any other.
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", FutureWarning)  # the legacy API's deprecation
        if built == "before":
            scheduler = make_scheduler(inner)
            ref.build_scheduler()
        if api == "wrap_optimizer":
            optimizer = handle.wrap_optimizer(inner)
            scalers = optimizer._loss_scaler
            scale_loss = optimizer.scale_loss
        else:
            optimizer = inner
            scalers = [handle._default_scaler]
            scale_loss = lambda loss: handle.scale_loss(loss, inner)  # noqa: E731

        def iteration(seed: int, factor: float = 1.0) -> None:
            x, y = batch(seed)
            optimizer.zero_grad()
            with scale_loss(F.mse_loss(model(x), y) * factor) as scaled:
                scaled.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

        if built == "after":
            iteration(0)  # the handle has touched (or wrapped) the optimizer: then the scheduler
            ref.iteration(*batch(0), step=True)
            scheduler = make_scheduler(inner)
            ref.build_scheduler()
        before = [p.detach().clone() for p in model.parameters()]
        scale = scalers[0].loss_scale()
        iteration(1, factor=float("inf"))  # inf gradients: the step is skipped
        ref.iteration(*batch(1), step=False)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert scalers[0].loss_scale() == scale / 2
        for seed in (2, 3):  # and the next steps are taken
            iteration(seed)
            ref.iteration(*batch(seed), step=True)
    handle._deactivate()
    assert inner.param_groups[0]["lr"] == pytest.approx(ref.opt.param_groups[0]["lr"])
    assert not torch.equal(before[0], model[0].weight)
    for p, r in zip(model.parameters(), ref.model.parameters(), strict=True):
        torch.testing.assert_close(p, r, **CHAIN_TOL[half])


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["scheduler_first", "handle_first"])
def test_switching_the_handle_off_leaves_the_scheduler_counting(scheduler_first):
    model = _model()
    opt = _sgd(model)
    handle = amp.init(half_dtype=torch.bfloat16)
    scheduler = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler_first else None
    x, y = batch(0)
    with handle.scale_loss(F.mse_loss(model(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    if scheduler is None:
        scheduler = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    handle._deactivate()  # the pending skip is dropped with the handle
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # taken, and seen by the scheduler
        scheduler.step()
    assert not torch.equal(before, model[0].weight)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
