"""``amp._amp_state``: Apex's state object as scripts and Apex's own tests read it."""

from __future__ import annotations

import pytest
import torch

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp
from amp_core.amp import _amp_state


def _setup(opt_level: str, **kwargs: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kwargs)


def test_before_initialize_there_are_no_properties_and_no_scalers() -> None:
    amp.close()
    # atorch and others probe with hasattr before reading opt_properties.enabled
    assert not hasattr(_amp_state, "opt_properties")
    assert _amp_state.loss_scalers == []
    assert amp._amp_state is _amp_state


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_properties_and_scalers_are_the_latest_initialize_calls(opt_level: str) -> None:
    _setup(opt_level, num_losses=2, loss_scale=128.0)
    props = _amp_state.opt_properties
    assert props.opt_level == opt_level and props.enabled
    assert props.master_weights is (opt_level == "O2")
    assert props.loss_scale == 128.0
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [128.0, 128.0]
    assert not _amp_state.loss_scalers[0].dynamic
    _setup("O1")  # a later call owns the names
    assert _amp_state.opt_properties.opt_level == "O1"
    assert len(_amp_state.loss_scalers) == 1 and _amp_state.loss_scalers[0].dynamic
    assert _amp_state.loss_scalers[0]._loss_scale == 2.0**16


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_setting_loss_scale_sets_the_scale_the_next_backward_uses(opt_level: str) -> None:
    # Apex's tests and NVIDIA's BERT scripts write _amp_state.loss_scalers[0]._loss_scale.
    model, optimizer = _setup(opt_level)
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled.item() == pytest.approx(4.0 * loss.item(), rel=1e-6)
        scaled.backward()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 4.0
    assert _amp_state.loss_scalers[0].loss_scale() == 4.0


def test_a_bad_loss_scale_is_refused_with_the_value() -> None:
    _setup("O1")
    with pytest.raises(ValueError, match="loss_scale"):
        _amp_state.loss_scalers[0]._loss_scale = float("nan")
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**16


def test_the_view_is_read_only_except_apex_tests_flags() -> None:
    _setup("O1")
    with pytest.raises(AttributeError, match="read-only view"):
        _amp_state.loss_scalers = []
    with pytest.raises(AttributeError, match="only _loss_scale can be set"):
        _amp_state.loss_scalers[0].dynamic = False
    with pytest.raises(AttributeError, match=r"amp\.scale_loss and optimizer\.step"):
        _amp_state.loss_scalers[0].update_scale()
    with pytest.raises(AttributeError, match="no attribute 'lossy'"):
        _ = _amp_state.lossy
    # Apex's tests set these around amp.initialize; amp_core already accepts such models.
    _amp_state.allow_incoming_model_not_fp32 = True
    assert _amp_state.allow_incoming_model_not_fp32 is True
    _amp_state.allow_incoming_model_not_fp32 = False


def test_handle_deactivate_switches_the_o1_casting_off() -> None:
    model, _ = _setup("O1")
    x = torch.randn(2, 4)
    assert _amp_state.handle.is_active()
    assert model(x).dtype != torch.float32  # cast by O1
    _amp_state.handle._deactivate()
    assert not _amp_state.handle.is_active()
    assert model(x).dtype == torch.float32
