"""Under O1 the backward runs without autocast, as under Apex and after a torch.autocast block.

Apex's O1 casts were patches of the forward functions, so backward ops ran in the dtypes the
forward saved; PyTorch's autocast is left before ``backward()``. O1 keeps autocast on for its
thread, so the ``amp.scale_loss`` block suspends it while the backward runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES

from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_backward_ops_see_no_autocast(half):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
    x, y = batch(0)
    seen = []
    hidden = model[0](x)
    hidden.register_hook(lambda g: seen.append(torch.is_autocast_enabled("cpu")))
    loss = F.mse_loss(model[2](model[1](hidden)).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert seen == [False]
    assert torch.is_autocast_enabled("cpu")  # O1 casting is back on after the block


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_gradients_equal_torch_autocast_gradients(half):
    """With no scaling, an O1 backward computes what the torch.autocast backward computes."""
    x, y = batch(1)
    reference = tiny_mlp()
    with torch.autocast("cpu", dtype=half):
        out = reference(x)
    F.mse_loss(out.float(), y).backward()

    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=half, loss_scale=1.0, verbosity=0
    )
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, ref.grad)


class _Funcs:
    """A namespace for a user function registered with amp (as a module attribute would be)."""

    @staticmethod
    def scale_up(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0


class _Checkpointed(torch.nn.Module):
    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(4, 8)
        self.outer = torch.nn.Linear(8, 3)
        self.checkpoint = checkpoint

    def segment(self, x: torch.Tensor) -> torch.Tensor:
        return _Funcs.scale_up(self.inner(x).float()).softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.segment, x, use_reentrant=False)
        else:
            h = self.segment(x)
        return self.outer(h)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_checkpointed_forward_recomputes_with_the_user_registrations(half):
    """A forward recomputed in the backward (activation checkpointing) is cast as the original
    one: a registered half function stays in force while the backward runs."""
    x, y = batch(2)
    grads = {}
    amp.register_half_function(_Funcs, "scale_up")
    for checkpoint in (False, True):
        model = _Checkpointed(checkpoint)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(
            model, opt, opt_level="O1", half_dtype=half, loss_scale=1.0, verbosity=0
        )
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads[checkpoint] = [p.grad.clone() for p in model.parameters()]
        amp.close()
    for plain, recomputed in zip(grads[False], grads[True], strict=True):
        assert torch.equal(plain, recomputed)
