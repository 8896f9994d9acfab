"""The pre-1.0 ``amp.init()`` handle: O1 casting from amp-core, scale_loss, OptimWrapper."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES

from _legacy_helpers import batch
from amp_core import amp as core_amp
from amp_core import o1_casting_active
from amp_legacy_fp16 import amp


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_init_switches_o1_on_and_deactivate_undoes_it(half):
    with pytest.warns(FutureWarning, match='opt_level="O1"'):
        handle = amp.init(half_dtype=half)
    assert handle.is_active() and o1_casting_active()
    model = _model()
    out = model(torch.randn(2, 4))
    assert out.dtype == half  # linear in the half dtype
    assert torch.softmax(out, dim=1).dtype == torch.float32  # Apex's fp32 list
    handle._deactivate()
    assert not handle.is_active() and not o1_casting_active()
    assert model(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_scale_loss_leaves_unscaled_fp32_grads(half):
    model = _model()
    ref = _model()
    handle = amp.init(half_dtype=half, loss_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    with handle.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        assert scaled.item() == pytest.approx(1024.0 * F.mse_loss(model(x), y).item(), rel=1e-2)
        scaled.backward()
    handle._deactivate()
    F.mse_loss(ref(x), y).backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, r.grad, **CHAIN_TOL[half])


def test_overflow_skips_one_step():
    handle = amp.init(half_dtype=torch.bfloat16)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    with handle.scale_loss(F.mse_loss(model(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    with handle.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before[0], model[0].weight)
    assert handle._default_scaler.loss_scale() == 2.0**15  # amp's 2**16, halved once


def test_wrap_optimizer_with_two_losses():
    model = _model()
    ref = _model()
    handle = amp.init(half_dtype=torch.bfloat16)
    with pytest.warns(FutureWarning, match="num_losses"):
        opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    x, y = batch(1)
    with opt.scale_loss(F.mse_loss(model(x), y)) as scaled:
        scaled.backward()
    with opt.scale_loss(model(x).abs().mean()) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="num_loss=3"), opt.scale_loss(model(x).sum()):
        pass
    with (
        pytest.raises(RuntimeError, match=r"optimizer\.scale_loss"),
        handle.scale_loss(torch.ones(()), opt),
    ):
        pass
    handle._deactivate()
    (F.mse_loss(ref(x), y) + ref(x).abs().mean()).backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, **CHAIN_TOL[torch.bfloat16])
    assert opt.param_groups[0]["lr"] == 0.1  # attributes pass through


def test_wrapper_overflow_skips_and_refuses_closures():
    model = _model()
    handle = amp.init(half_dtype=torch.bfloat16)
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(2)
    with opt.scale_loss(F.mse_loss(model(x), y)) as scaled:
        scaled.backward()
    with opt.scale_loss(F.mse_loss(model(x), y) * float("inf")) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)


def test_disabled_handle_is_a_noop():
    handle = amp.init(enabled=False)
    assert not handle.is_active() and not o1_casting_active()
    loss = torch.tensor(3.0, requires_grad=True)
    opt = torch.optim.SGD([loss], lr=0.1)
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    wrapped = handle.wrap_optimizer(opt)
    with wrapped.scale_loss(loss) as scaled:
        assert scaled is loss
    handle._deactivate()


def test_banned_binary_cross_entropy_and_allow_banned():
    original = F.binary_cross_entropy
    p, target = torch.rand(4, 2) * 0.8 + 0.1, torch.rand(4, 2)
    handle = amp.init(half_dtype=torch.bfloat16)
    # As Apex's amp.init: refused (NotImplementedError) when an input is half; fp32 runs.
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(p.bfloat16(), target)
    assert F.binary_cross_entropy(p, target).dtype == torch.float32
    handle._deactivate()
    handle = amp.init(half_dtype=torch.bfloat16, allow_banned=True)
    got = F.binary_cross_entropy(p.bfloat16(), target)
    assert got.dtype == torch.float32
    assert torch.nn.BCELoss()(p, target).dtype == torch.float32
    handle._deactivate()
    assert F.binary_cross_entropy is original
    expected = -(
        target * p.bfloat16().float().log() + (1 - target) * (1 - p.bfloat16().float()).log()
    )
    torch.testing.assert_close(got, expected.mean(), rtol=1e-5, atol=1e-6)


def test_caching_flag_and_second_init():
    assert torch.is_autocast_cache_enabled()
    first = amp.init(half_dtype=torch.bfloat16, enable_caching=False)
    assert not torch.is_autocast_cache_enabled()
    second = amp.init(half_dtype=torch.bfloat16)  # switches the first one off
    assert not first.is_active() and second.is_active()
    second._deactivate()
    assert torch.is_autocast_cache_enabled()


def test_init_after_amp_initialize_o1_takes_over_casting():
    model = _model()
    core_amp.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    handle = amp.init(half_dtype=torch.bfloat16)
    assert handle.is_active()
    handle._deactivate()
    assert not o1_casting_active()


def test_registrations_are_amp_cores():
    assert amp.register_float_function is core_amp.register_float_function


@pytest.mark.parametrize("switch_off", ["amp.initialize", "amp.close", "amp.init"])
def test_switching_the_handle_off_from_amp_core_drops_its_pending_skip(switch_off):
    handle = amp.init(half_dtype=torch.bfloat16)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    with handle.scale_loss(F.mse_loss(model(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    assert "step" in opt.__dict__  # the next step is to be skipped
    if switch_off == "amp.initialize":
        core_amp.initialize(_model(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    elif switch_off == "amp.close":
        core_amp.close()
    else:
        amp.init(half_dtype=torch.bfloat16)
    assert not handle.is_active()
    assert "step" not in opt.__dict__  # nothing of the old handle is left on the optimizer
