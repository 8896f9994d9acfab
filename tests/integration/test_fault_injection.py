"""Fault injection: 300 training steps with bursts of inf/nan batches, at every mixed-precision
entry point of the toolkit (amp O1, O2, O3 with a static scale, both FP16_Optimizers), in
float16 and bfloat16.

After every step: a skipped step left the parameters, the fp32 masters and the optimizer state
bitwise as they were; everything is finite; the loss scale is within [floor, ceiling]. One
burst is long enough to take a dynamic scale down to its floor, and training still converges
after the bursts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES
from torch import nn

from amp_core import amp

STEPS = 300
LONG_BURST = range(100, 150)  # 50 bad batches: more halvings than any scale here needs
BURSTS = [range(20, 23), range(60, 62), LONG_BURST, range(200, 204)]
BAD_STEPS = {s for burst in BURSTS for s in burst}
W_TRUE = torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.5, 0.5, -0.75, 0.0]])


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=g)
    y = x @ W_TRUE.T
    if step in BAD_STEPS:  # inf, nan, or both in the inputs
        kind = step % 3
        x = x.clone()
        x[step % 16, step % 4] = (float("inf"), float("nan"), float("-inf"))[kind]
        if kind == 2:
            x[0, 0] = float("nan")
    return x, y


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)).to(dtype)


def eval_loss(model: nn.Module) -> float:
    g = torch.Generator().manual_seed(10_000)
    x = torch.randn(256, 4, generator=g)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model(x.to(dtype)).float()
    return float(F.mse_loss(out, x @ W_TRUE.T))


def tensors_of(state: dict[Any, Any]) -> list[torch.Tensor]:
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class Run:
    """One way of training: a step that reports whether it was skipped, and what it keeps."""

    floor: float
    ceiling: float
    dynamic: bool

    def step(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """Params, masters and optimizer state (clones)."""
        raise NotImplementedError

    def scale(self) -> float:
        raise NotImplementedError

    model: nn.Module


class AmpRun(Run):
    def __init__(self, opt_level: str, half: torch.dtype) -> None:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.ceiling = 2.0**24
        if opt_level == "O3":  # a static scale
            kw: dict[str, Any] = {"loss_scale": 128.0 if half == torch.float16 else 1.0}
            self.dynamic = False
        elif half == torch.float16:  # Apex's min_loss_scale as the floor
            kw = {"loss_scale": "dynamic", "min_loss_scale": 1.0}
            self.dynamic, self.floor = True, 1.0
        else:  # the default floor
            kw = {"loss_scale": "dynamic"}
            self.dynamic, self.floor = True, 2.0**-24
        self.model, self.opt = amp.initialize(
            model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kw
        )
        if not self.dynamic:
            self.floor = self.ceiling = kw["loss_scale"]
        self.half = half if opt_level != "O1" else torch.float32

    def step(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        skipped = amp.skipped_steps(self.opt)
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x).float(), y)
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()
        return amp.skipped_steps(self.opt) == skipped + 1

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + list(amp.master_params(self.opt))
        return [t.detach().clone() for t in out + tensors_of(self.opt.state)]

    def scale(self) -> float:
        return float(amp.state_dict()["loss_scaler0"]["loss_scale"])


class LegacyRun(Run):
    def __init__(self, half: torch.dtype) -> None:
        from amp_legacy_fp16 import FP16_Optimizer

        self.model = make_model(half)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.opt = FP16_Optimizer(
                torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9),
                dynamic_loss_scale=True,
                dynamic_loss_args={"init_scale": 2.0**16},  # 2**32 overflows a few clean steps
                verbose=False,
            )
        self.dynamic, self.floor, self.ceiling = True, 1.0, math.inf  # Apex's: no ceiling

    def step(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        self.opt.zero_grad()
        dtype = next(self.model.parameters()).dtype
        self.opt.backward(F.mse_loss(self.model(x.to(dtype)).float(), y))
        skipped = self.opt.overflow
        self.opt.step()
        return skipped

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + self.opt.all_fp32_from_fp16_params
        return [t.detach().clone() for t in out + tensors_of(self.opt.optimizer.state)]

    def scale(self) -> float:
        return self.opt.loss_scale


class FusedRun(Run):
    def __init__(self, half: torch.dtype) -> None:
        from amp_optimizers import FP16_Optimizer, FusedAdam

        self.model = make_model(half)
        self.opt = FP16_Optimizer(
            FusedAdam(self.model.parameters(), lr=5e-3), dynamic_loss_scale=True, verbose=False
        )
        self.dynamic, self.floor, self.ceiling = True, 1.0, math.inf  # Apex's: no ceiling

    def step(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        self.opt.zero_grad()
        dtype = next(self.model.parameters()).dtype
        self.opt.backward(F.mse_loss(self.model(x.to(dtype)).float(), y))
        self.opt.step()
        return self.opt.last_overflow_iter == self.opt.cur_iter - 1

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + list(self.opt.fp32_groups_flat)
        return [t.detach().clone() for t in out + tensors_of(self.opt.optimizer.state)]

    def scale(self) -> float:
        return self.opt.loss_scale


RUNS: dict[str, Callable[[torch.dtype], Run]] = {
    "amp-O1": lambda half: AmpRun("O1", half),
    "amp-O2": lambda half: AmpRun("O2", half),
    "amp-O3-static": lambda half: AmpRun("O3", half),
    "FP16_Optimizer-legacy": LegacyRun,
    "FP16_Optimizer-FusedAdam": FusedRun,
}


@pytest.mark.slow
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("kind", list(RUNS))
def test_bursts_of_bad_batches_never_corrupt_training(kind: str, half: torch.dtype) -> None:
    run = RUNS[kind](half)
    start = eval_loss(run.model)
    scales = []
    clean_skips = 0
    after_long_burst = None
    for step in range(STEPS):
        before = run.tensors()
        skipped = run.step(*make_batch(step))
        after = run.tensors()
        if step in BAD_STEPS:
            assert skipped, f"step {step}: a batch holding inf/nan was not skipped"
        clean_skips += int(skipped and step not in BAD_STEPS)
        if skipped:
            for a, b in zip(after, before, strict=True):
                assert torch.equal(a, b), f"step {step}: a skipped step changed a tensor"
        assert all(bool(t.isfinite().all()) for t in after), f"step {step}: not finite"
        scale = run.scale()
        assert run.floor <= scale <= run.ceiling and math.isfinite(scale), (step, scale)
        scales.append(scale)
        if step == LONG_BURST[-1]:
            after_long_burst = eval_loss(run.model)

    if run.dynamic:
        assert min(scales) == run.floor  # the long burst reached the floor, and stopped there
    assert clean_skips <= 3  # the clean batches train
    end = eval_loss(run.model)
    assert after_long_burst is not None
    assert end < 0.5 * start, (start, after_long_burst, end)
    assert end <= after_long_burst * 1.05, (start, after_long_burst, end)
