"""docs/fp16_optimizer_migration.rst: amp O2 is FP16_Optimizer with dynamic loss scaling.

The same fp32-initialized model is trained both ways with fp16 params: FP16_Optimizer on the
model cast by ``convert_network``, and ``amp.initialize(opt_level="O2")``. Both use the same
dynamic scaler settings (init 2**16, window 2000) so that they skip the same steps.

The one difference: O2 builds its fp32 masters from the fp32 weights before the cast, while
FP16_Optimizer only sees the fp16 model and starts its masters from the rounded weights. The
initial masters therefore differ by at most half an fp16 ulp (relative 2**-11 ~ 4.9e-4), and
that difference is carried (not amplified, at this learning rate) through the SGD updates. The
largest relative loss difference observed is 1.0e-3 (one fp16 op's bound, torch.testing's
float16 rtol); the tolerance, rtol 2e-3, doubles it for the 20 chained fp16 forward/backward passes.
With weights that fp16 represents exactly, the two
trajectories are bitwise equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from amp_core import amp as core_amp
from amp_legacy_fp16 import FP16_Optimizer, convert_network

STEPS = 20
SCALER = {"init_scale": 2.0**16, "scale_window": 2000}  # amp's dynamic defaults


def _fp32_model(round_to_fp16: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    if round_to_fp16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    return model


def _batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=g)
        yield x, torch.stack([x[:, :4].sum(1), x[:, 4:].mean(1)], dim=1)


def _fp16_optimizer_run(model):
    model = convert_network(copy.deepcopy(model), torch.float16)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args=SCALER,
        verbose=False,
    )
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x.half()).float(), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    masters = [m.detach() for m in opt.fp32_from_fp16_groups[0]]
    return torch.tensor(losses), masters


def _amp_o2_run(model):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = core_amp.initialize(
        model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0
    )
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)  # O2 casts the input to fp16 and the output to fp32
        with core_amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    masters = [m.detach() for m in core_amp.master_params(opt)]
    return torch.tensor(losses), masters


def test_o2_trajectory_matches_fp16_optimizer():
    model = _fp32_model(round_to_fp16=False)
    legacy_losses, legacy_masters = _fp16_optimizer_run(model)
    amp_losses, amp_masters = _amp_o2_run(model)
    assert legacy_losses[-1] < 0.5 * legacy_losses[0]  # it trained
    torch.testing.assert_close(legacy_losses, amp_losses, rtol=2e-3, atol=1e-4)
    for a, b in zip(legacy_masters, amp_masters, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("round_to_fp16", [True], ids=["fp16-exact-init"])
def test_o2_is_bitwise_fp16_optimizer_when_init_is_fp16_exact(round_to_fp16):
    model = _fp32_model(round_to_fp16)
    legacy_losses, legacy_masters = _fp16_optimizer_run(model)
    amp_losses, amp_masters = _amp_o2_run(model)
    assert torch.equal(legacy_losses, amp_losses)
    assert all(torch.equal(a, b) for a, b in zip(legacy_masters, amp_masters, strict=True))
