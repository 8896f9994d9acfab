"""amp_core.MasterWeights: masters, unscaling into them, and the step or its skip."""

from __future__ import annotations

import pytest
import torch

from amp_core import LossScaler, MasterWeights, read_overflow


def _optimizer():
    half = torch.nn.Parameter(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    full = torch.nn.Parameter(torch.tensor([0.5, 4.0]))
    opt = torch.optim.SGD([half, full], lr=0.5, momentum=0.9)
    return half, full, opt


def test_adopt_group_puts_fp32_masters_in_place_of_half_params():
    half, full, opt = _optimizer()
    opt.state[half] = {"momentum_buffer": torch.ones(2, dtype=torch.bfloat16)}
    weights = MasterWeights()
    pairs = weights.adopt_group(opt.param_groups[0], opt.state)
    ((model_param, master),) = pairs
    assert model_param is half and master.dtype == torch.float32
    assert torch.equal(master.detach(), half.detach().float())
    assert opt.param_groups[0]["params"] == [master, full]
    assert weights.direct_params == [full]
    assert half not in opt.state
    assert opt.state[master]["momentum_buffer"].dtype == torch.float32


def test_unscale_direct_grads_unscales_only_the_new_gradients():
    _, full, _ = _optimizer()
    scaler = LossScaler(8.0)
    weights = MasterWeights([full])
    full.grad = torch.tensor([1.0, 2.0])  # unscaled, from an earlier backward
    weights.set_aside_grads()
    assert full.grad is None
    full.grad = torch.tensor([8.0, 16.0])  # this backward's, scaled by 8
    found_inf = torch.zeros(())
    weights.unscale_direct_grads(scaler, found_inf, check=True)
    assert torch.equal(full.grad, torch.tensor([2.0, 4.0]))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("accumulate", [True, False])
def test_unscale_into_masters(accumulate):
    half, _, opt = _optimizer()
    weights = MasterWeights()
    weights.adopt_group(opt.param_groups[0], opt.state)
    master = weights.masters[0]
    master.grad = torch.tensor([10.0, 10.0])
    half.grad = torch.tensor([4.0, -8.0], dtype=torch.bfloat16)
    found_inf = torch.zeros(())
    weights.unscale_into_masters(LossScaler(4.0), found_inf, check=True, accumulate=accumulate)
    if accumulate:  # amp O2: added to the master's grad, the half grad freed
        assert torch.equal(master.grad, torch.tensor([11.0, 8.0]))
        assert half.grad is None
    else:  # FP16_Optimizer: the master's grad replaced, the half grad kept
        assert torch.equal(master.grad, torch.tensor([1.0, -2.0]))
        assert half.grad is not None
    assert master.grad.dtype == torch.float32


def test_unscale_into_masters_raises_the_flag_on_inf():
    half, _, opt = _optimizer()
    weights = MasterWeights()
    weights.adopt_group(opt.param_groups[0], opt.state)
    half.grad = torch.tensor([float("inf"), 1.0], dtype=torch.bfloat16)
    found_inf = torch.zeros(())
    weights.unscale_into_masters(LossScaler(2.0), found_inf, check=True)
    assert read_overflow(found_inf) == (True, [])


def test_step_is_skipped_on_overflow_and_copies_masters_otherwise():
    half, _, opt = _optimizer()
    weights = MasterWeights()
    weights.adopt_group(opt.param_groups[0], opt.state)
    master = weights.masters[0]
    calls = []

    def step():
        calls.append(1)
        with torch.no_grad():
            master.add_(1.0)
        return "stepped"

    assert weights.step(step, overflow=True) is None
    assert calls == [] and torch.equal(half.detach().float(), torch.tensor([1.5, -2.25]))
    assert weights.step(step, overflow=False) == "stepped"
    assert torch.equal(half.detach().float(), torch.tensor([2.5, -1.25]))


def test_read_overflow_reads_the_scales_in_the_same_sync():
    scaler = LossScaler("dynamic", init_scale=64.0)
    scaler.scale_tensor(torch.device("cpu"))
    scaler.update_(torch.ones(()))  # an overflow halves it
    assert read_overflow(torch.zeros(()), [scaler]) == (False, [32.0])
