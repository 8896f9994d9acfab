"""ScalerConfig: validated settings, the named presets, and the scalers built from them."""

import math

import pytest
import torch

from amp_core import SCALER_PRESETS, LossScaler, OptLevel, Properties, ScalerConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scale_factor": 1.0}, ValueError, r"scale_factor must be greater than 1, got 1\.0"),
        ({"scale_factor": 0.5}, ValueError, r"scale_factor must be greater than 1, got 0\.5"),
        ({"scale_factor": math.inf}, ValueError, r"scale_factor .* got inf"),
        ({"scale_factor": "2"}, TypeError, r"scale_factor must be a number, got str '2'"),
        ({"scale_window": 0}, ValueError, r"scale_window must be a positive int, got 0"),
        ({"scale_window": 2.5}, ValueError, r"scale_window must be a positive int, got 2\.5"),
        ({"scale_window": True}, TypeError, r"scale_window must be a number, got bool"),
        ({"init_scale": 0.0}, ValueError, r"init_scale must be positive and finite, got 0\.0"),
        ({"init_scale": math.nan}, ValueError, r"init_scale must be positive and finite, got nan"),
        ({"max_loss_scale": 0.0}, ValueError, r"max_loss_scale must be positive, got 0\.0"),
        ({"min_loss_scale": 1e-40}, ValueError, r"min_loss_scale must be at least 2\*\*-126"),
        ({"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ValueError, r"min_loss_scale=8\.0 is"),
        ({"loss_scale": -1.0}, ValueError, r"static loss_scale must be positive and finite"),
        ({"loss_scale": "dynamc"}, ValueError, r"'dynamic' or a positive number, got 'dynamc'"),
    ],
)
def test_config_refuses_impossible_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ScalerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_factor": 1.0}, r"scale_factor must be greater than 1, got 1\.0"),
        ({"scale_window": 0}, r"scale_window must be a positive int, got 0"),
        ({"init_scale": -4.0}, r"init_scale must be positive and finite, got -4\.0"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, r"min_loss_scale=4\.0 is larger"),
    ],
)
def test_keyword_constructor_validates_through_the_config(kwargs, match):
    # Apex's keyword constructor accepted all of these; each would break the scale update.
    with pytest.raises(ValueError, match=match):
        LossScaler("dynamic", **kwargs)


def test_config_is_frozen_and_normalised():
    config = ScalerConfig(init_scale=1024, scale_window=10.0, max_loss_scale=math.inf)
    assert config.init_scale == 1024.0 and isinstance(config.init_scale, float)
    assert config.scale_window == 10 and isinstance(config.scale_window, int)
    with pytest.raises(AttributeError):
        config.scale_window = 3  # type: ignore[misc]


def test_presets_hold_apex_defaults():
    # apex/amp/scaler.py, apex/fp16_utils/loss_scaler.py, apex/optimizers/fp16_optimizer.py
    amp = SCALER_PRESETS["amp"]
    assert (amp.init_scale, amp.scale_factor, amp.scale_window) == (2.0**16, 2.0, 2000)
    assert (amp.min_loss_scale, amp.max_loss_scale) == (None, 2.0**24)
    legacy = SCALER_PRESETS["fp16_utils"]
    assert (legacy.init_scale, legacy.scale_window) == (2.0**32, 1000)
    assert (legacy.min_loss_scale, legacy.max_loss_scale) == (1.0, math.inf)
    fused = SCALER_PRESETS["fused_fp16_optimizer"]
    assert (fused.init_scale, fused.scale_window) == (2.0**16, 1000)
    assert (fused.min_loss_scale, fused.max_loss_scale) == (1.0, math.inf)
    with pytest.raises(TypeError):
        SCALER_PRESETS["mine"] = amp  # type: ignore[index]


def test_preset_with_overrides_is_checked():
    config = ScalerConfig.preset("fp16_utils", scale_window=7)
    assert config.scale_window == 7 and config.init_scale == 2.0**32
    with pytest.raises(ValueError, match=r"scale_factor must be greater than 1, got 1"):
        ScalerConfig.preset("fp16_utils", scale_factor=1)
    with pytest.raises(ValueError, match=r"Unknown loss scaler preset 'apex'.*'amp'"):
        ScalerConfig.preset("apex")


def test_from_config_behaves_as_the_keyword_constructor():
    grads = [torch.full((3,), 8.0)]
    by_config = LossScaler.from_config(ScalerConfig(init_scale=4.0, scale_window=1))
    by_keywords = LossScaler("dynamic", init_scale=4.0, scale_window=1)
    for scaler in (by_config, by_keywords):
        found_inf = torch.zeros(())
        scaler.unscale_([g.clone() for g in grads], found_inf)
        scaler.update_(found_inf)  # a clean step with a window of 1: the scale doubles
        assert scaler.loss_scale() == 8.0
    assert by_keywords.config == by_config.config
    with pytest.raises(TypeError, match="takes a ScalerConfig, got dict"):
        LossScaler.from_config({"init_scale": 4.0})  # type: ignore[arg-type]


def test_fp16_utils_preset_floor_and_ceiling_are_applied():
    scaler = LossScaler.from_config(ScalerConfig.preset("fp16_utils", init_scale=2.0))
    for _ in range(3):  # overflow three times: 2 -> 1, then held at the floor of 1
        scaler.update_(torch.ones(()))
    assert scaler.loss_scale() == 1.0
    assert scaler.ceiling == 2.0**127  # no ceiling below float32's largest power of two


def _props(**changes):
    values = dict(
        enabled=True,
        opt_level=OptLevel.O2,
        half_dtype=torch.float16,
        cast_model_type=torch.float16,
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    )
    values.update(changes)
    return Properties(**values)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"half_dtype": torch.float32}, ValueError, "half_dtype must be torch.float16"),
        ({"cast_model_type": torch.int8}, ValueError, "cast_model_type must be torch.float16"),
        ({"opt_level": "O2"}, TypeError, "opt_level must be an OptLevel, got 'O2'"),
        ({"master_weights": None}, TypeError, "master_weights must be a bool, got None"),
        ({"loss_scale": 0.0}, ValueError, "loss_scale must be 'dynamic' or a positive number"),
        ({"cast_model_outputs": torch.int32}, TypeError, "cast_model_outputs must be a floating"),
        ({"min_loss_scale": 0.0}, ValueError, "min_loss_scale must be at least"),
        ({"max_loss_scale": -1.0}, ValueError, r"max_loss_scale must be positive, got -1\.0"),
    ],
)
def test_properties_cannot_be_built_unvalidated(changes, error, match):
    with pytest.raises(error, match=match):
        _props(**changes)


def test_properties_give_their_scaler_config():
    props = _props(loss_scale=128, min_loss_scale=1, max_loss_scale=2**20)
    assert props.loss_scale == 128.0
    config = props.scaler_config()
    assert config == ScalerConfig(loss_scale=128.0, min_loss_scale=1.0, max_loss_scale=2.0**20)
