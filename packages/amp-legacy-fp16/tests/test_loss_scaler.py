"""LossScaler and DynamicLossScaler: Apex's defaults, growth rule, overflow check, backward."""

from __future__ import annotations

import random

import pytest
import torch
from amp_test_support import HALF_DTYPES

from amp_legacy_fp16 import DynamicLossScaler, LossScaler


def test_defaults_are_apex_legacy_ones():
    dynamic = DynamicLossScaler()
    assert dynamic.loss_scale == 2.0**32
    assert dynamic.scale_factor == 2.0
    assert dynamic.scale_window == 1000
    assert LossScaler().loss_scale == 1.0
    assert LossScaler(64).loss_scale == 64.0


def test_constructors_warn_with_replacement():
    with pytest.warns(FutureWarning, match='loss_scale="dynamic"'):
        DynamicLossScaler()
    with pytest.warns(FutureWarning, match="amp_core.amp.initialize"):
        LossScaler(8)


def _apex_rule(init, factor, window, overflows):
    """Apex's fp16_utils update rule, written out independently: the expected scales."""
    scale, last_overflow = init, -1
    out = []
    for cur_iter, overflow in enumerate(overflows):
        if overflow:
            scale = max(scale / factor, 1)
            last_overflow = cur_iter
        elif (cur_iter - last_overflow) % window == 0:
            scale *= factor
        out.append(scale)
    return out


@pytest.mark.parametrize("window", [1, 3, 7])
def test_growth_and_backoff_follow_apex_rule(window):
    rng = random.Random(window)
    overflows = [rng.random() < 0.2 for _ in range(60)]
    overflows[10:16] = [True] * 6  # drive the scale to its floor of 1
    scaler = DynamicLossScaler(init_scale=8.0, scale_factor=2.0, scale_window=window)
    got = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        got.append(scaler.loss_scale)
    assert got == _apex_rule(8.0, 2.0, window, overflows)
    assert min(got) >= 1.0
    assert scaler.cur_iter == len(overflows)


def test_static_scaler_never_changes_nor_checks():
    scaler = LossScaler(16.0)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    assert scaler.has_overflow([p]) is False
    scaler.update_scale(True)
    assert scaler.loss_scale == 16.0


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_overflow_finds_one_bad_value(half, bad):
    scaler = DynamicLossScaler()
    params = [torch.nn.Parameter(torch.ones(5, dtype=half)) for _ in range(3)]
    params.append(torch.nn.Parameter(torch.ones(3)))  # one without a grad
    for p in params[:3]:
        p.grad = torch.full_like(p, 60000.0 if half == torch.float16 else 1e30)
    assert scaler.has_overflow(params) is False
    params[1].grad[3] = bad
    assert scaler.has_overflow(params) is True


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_backward_scales_the_gradient(half):
    w = torch.nn.Parameter(torch.tensor([0.5, -1.5], dtype=half))
    x = torch.tensor([3.0, 2.0])
    LossScaler(128.0).backward((w * x.to(half)).sum())
    torch.testing.assert_close(w.grad.float(), 128.0 * x)  # exact: powers of two


def test_cur_scale_is_writable_and_rejects_nonpositive():
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.cur_scale = 32.0
    assert scaler.loss_scale == 32.0
    with pytest.raises(ValueError, match="positive"):
        scaler.cur_scale = 0.0


def test_invalid_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="scale_factor must be greater than 1"):
        DynamicLossScaler(scale_factor=1.0)
    with pytest.raises(ValueError, match="must be positive"):
        LossScaler(-1)
