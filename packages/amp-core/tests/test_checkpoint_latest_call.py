"""A checkpoint loads into the latest ``amp.initialize`` call while earlier calls' objects live.

The usual resume test (Apex's own is built this way): train a model, save model, optimizer and
amp state, build a second model and optimizer in the same process, call ``amp.initialize`` for
them, load the checkpoint, and train both side by side: they must agree exactly, loss scalers
included, without deleting the first model and optimizer.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES

from _amp_core_helpers import batch, tiny_bn_net
from amp_core import amp

N_STEPS, SAVE_AFTER, POISONED = 6, 3, 1


def _initialize(model, opt, opt_level, half, num_losses):
    # A dynamic scale at O1/O2 in both dtypes, so that the scalers have a state to restore.
    scale = {"loss_scale": "dynamic"} if opt_level in ("O1", "O2") else {}
    return amp.initialize(
        model,
        opt,
        opt_level=opt_level,
        half_dtype=half,
        num_losses=num_losses,
        verbosity=0,
        **scale,
    )


def _train_step(model, opt, step: int, opt_level: str, num_losses: int) -> torch.Tensor:
    opt.zero_grad()
    x, y = batch(step)
    output = model(x)
    for loss_id in range(num_losses):
        loss = F.mse_loss(output.float(), y) * (loss_id + 1)
        if step == POISONED and loss_id == num_losses - 1 and opt_level != "O0":
            loss = loss * float("inf")  # a skipped step: the scale moves before the checkpoint
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward(retain_graph=loss_id < num_losses - 1)
    opt.step()
    return output.detach()


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("amp_before_load", [True, False], ids=["amp_first", "load_first"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_resume_next_to_the_first_run(opt_level, half, amp_before_load, num_losses):
    model = tiny_bn_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = _initialize(model, opt, opt_level, half, num_losses)
    restored = restored_opt = None
    for step in range(N_STEPS):
        output = _train_step(model, opt, step, opt_level, num_losses)
        if step == SAVE_AFTER - 1:
            checkpoint = _round_trip(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "amp": amp.state_dict(),
                }
            )
            restored = tiny_bn_net(1)  # other initial weights
            restored_opt = torch.optim.SGD(restored.parameters(), lr=0.05, momentum=0.9)
            if amp_before_load:
                restored, restored_opt = _initialize(
                    restored, restored_opt, opt_level, half, num_losses
                )
            restored.load_state_dict(checkpoint["model"])
            restored_opt.load_state_dict(checkpoint["optimizer"])
            if not amp_before_load:
                restored, restored_opt = _initialize(
                    restored, restored_opt, opt_level, half, num_losses
                )
            amp.load_state_dict(checkpoint["amp"])  # the first model and optimizer still live
        elif step >= SAVE_AFTER:
            restored_output = _train_step(restored, restored_opt, step, opt_level, num_losses)
            assert torch.equal(restored_output, output), f"outputs differ at step {step}"
            first, second = model.state_dict(), restored.state_dict()
            assert first.keys() == second.keys()
            for key in first:
                assert torch.equal(first[key], second[key]), f"{key} differs at step {step}"
            scalers = amp.state_dict()  # the latest call's and, prefixed, the first call's
            for j in range(num_losses):
                assert scalers[f"loss_scaler{j}"] == scalers[f"session1.loss_scaler{j}"]
    if opt_level in ("O1", "O2"):
        assert amp.state_dict()[f"loss_scaler{num_losses - 1}"]["loss_scale"] == 2.0**15
    assert amp.skipped_steps(restored_opt) == 0  # the skipped step was before the checkpoint


def _pair(seed: int):
    model = tiny_bn_net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale="dynamic", verbosity=0
    )


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 0, 1e300],
    ids=["1e400", "-1e400", "nan", "inf", "-inf", "negative", "zero", "int_zero", "1e300"],
)
def test_an_absurd_loss_scale_in_a_checkpoint_names_the_key(value):
    _pair(0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match=r'state_dict\["loss_scaler0"\]\["loss_scale"\]'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": value, "unskipped": 0}})
    assert amp.state_dict() == before


@pytest.mark.parametrize(
    "value", [-1, -(10**400), 2**31, 10**400], ids=["negative", "-1e400", "2**31", "1e400"]
)
@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_an_absurd_unskipped_count_in_a_checkpoint_names_the_key(value, loss_scale):
    model = tiny_bn_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale=loss_scale, verbosity=0
    )
    before = amp.state_dict()
    with pytest.raises(ValueError, match=r'state_dict\["loss_scaler0"\]\["unskipped"\]'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": value}})
    assert amp.state_dict() == before
    _train_step(model, opt, 0, "O1", 1)  # still usable


@pytest.mark.parametrize(
    "field, value",
    [
        ("init_scale", 10**400),
        ("scale_factor", 10**400),
        ("scale_window", 10**400),
        ("min_loss_scale", 10**400),
        ("scale_window", math.inf),
    ],
    ids=["init_scale", "scale_factor", "scale_window", "min_loss_scale", "scale_window_inf"],
)
def test_an_absurd_scaler_setting_names_the_setting(field, value):
    from amp_core import ScalerConfig

    with pytest.raises(ValueError, match=field):
        ScalerConfig(**{field: value})


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_optimizer_state_loaded_before_initialize_takes_the_half_dtype(half):
    """As ``Optimizer.load_state_dict`` casts state to its param's dtype: the momentum of a
    resumed O3 run is half, as in the run that saved it."""
    model = tiny_bn_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O3", half_dtype=half, verbosity=0)
    _train_step(model, opt, 0, "O3", 1)
    saved = _round_trip(opt.state_dict())
    fresh = tiny_bn_net(1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(saved)  # float32 momentum: the params are float32 still
    fresh, fresh_opt = amp.initialize(
        fresh, fresh_opt, opt_level="O3", half_dtype=half, verbosity=0
    )
    for p in fresh.parameters():
        assert fresh_opt.state[p]["momentum_buffer"].dtype == half
