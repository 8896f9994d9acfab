"""A static loss scale of one: nothing is scaled or unscaled, yet a non-finite step is skipped.

The check of the gradients is one fused pass that hands every value back unchanged; these tests
pin both halves of that: the skip, and gradients bitwise equal to those of a plain backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp

# O1 with an explicit scale of one, and O3, whose default static scale is one.
UNIT_LEVELS = [("O1", {"loss_scale": 1.0}), ("O3", {})]


def _init(opt_level: str, half: torch.dtype, kwargs: dict) -> tuple[torch.nn.Module, object]:
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kwargs)


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize(("opt_level", "kwargs"), UNIT_LEVELS, ids=[lv for lv, _ in UNIT_LEVELS])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unit_scale_skips_a_step_with_a_non_finite_gradient(half, opt_level, kwargs, bad):
    model, opt = _init(opt_level, half, kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    handle = model[2].bias.register_hook(lambda g: g.clone().index_fill_(0, torch.tensor([0]), bad))
    loss = F.mse_loss(model(x).float(), y.float())
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    handle.remove()
    opt.step()
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)
    assert amp.skipped_steps(opt) == 1


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize(("opt_level", "kwargs"), UNIT_LEVELS, ids=[lv for lv, _ in UNIT_LEVELS])
def test_unit_scale_check_leaves_gradients_bitwise(half, opt_level, kwargs):
    """Subnormal and signed-zero gradients come out of the check exactly as they went in."""
    model, opt = _init(opt_level, half, kwargs)
    weight = model[0].weight
    tiny = torch.finfo(weight.dtype).smallest_normal / 4  # a subnormal of the param's dtype
    pattern = torch.tensor([tiny, -tiny, 0.0, -0.0, 1.5, -3.0], dtype=weight.dtype)
    fill = pattern.repeat(weight.numel() // pattern.numel() + 1)[: weight.numel()]
    fill = fill.view_as(weight)
    handle = weight.register_hook(lambda g: fill.clone())
    x, y = batch(1)
    loss = F.mse_loss(model(x).float(), y.float())
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    handle.remove()
    assert weight.grad is not None
    assert torch.equal(
        weight.grad.view(torch.int16 if fill.element_size() == 2 else torch.int32),
        fill.view(torch.int16 if fill.element_size() == 2 else torch.int32),
    )
