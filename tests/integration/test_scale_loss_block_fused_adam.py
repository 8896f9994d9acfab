"""``with amp.scale_loss(...)`` on the fused master-weight path: amp O2 with
``amp_optimizers.FusedAdam`` (amp-core and amp-optimizers together).

The same blocks as amp-core's test_scale_loss_block.py, which runs them with a torch optimizer
at every level: exceptions inside the block, ``step()`` inside it, nested blocks and
``delay_unscale`` across loss ids. Every expected gradient and weight comes from a float32
PyTorch twin of the model stepped by ``torch.optim.Adam``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES
from torch import nn

from amp_core import amp
from amp_optimizers import FusedAdam

OPT_LEVEL = "O2"  # FusedAdam keeps the masters itself at O2 only

# Adam's first step is lr * sign(grad) for a small eps: a gradient element near 0 rounds to
# either sign in half precision. A large eps keeps the step proportional to the gradient.
ADAM_EPS = 1.0


class Boom(RuntimeError):
    """The failure of a bad batch."""


class _Trip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, armed):  # type: ignore[override]
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.armed:
            raise Boom("bad batch in backward")
        return grad, None


class Tripwire(nn.Module):
    """Identity; when armed, the backward through it raises (after the layers above it got
    their gradients: a partial backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Trip.apply(x, self.armed)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # BatchNorm stays float32 at O2: its params are stepped directly, the Linears via masters.
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), Tripwire(), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g) * 0.5, torch.randn(8, 3, generator=g) * 0.5


def _setup(half: torch.dtype, **kwargs):
    model = _net()
    ref = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=0.1, eps=ADAM_EPS)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1, eps=ADAM_EPS)
    model, opt = amp.initialize(
        model, opt, opt_level=OPT_LEVEL, half_dtype=half, verbosity=0, **kwargs
    )
    return model, opt, ref, ref_opt


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = _batch(seed)
    return F.mse_loss(model(x).float(), y)


def _grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in amp.master_params(opt)]


def _check_close(got: list[torch.Tensor], expected: list[torch.Tensor], tol) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tol)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


# ------------------------------------------------------------ an exception inside the block


@pytest.mark.parametrize("where", ["in_backward", "after_backward", "before_backward"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_failed_micro_batch_leaves_the_other_micro_batches_gradients(half, where):
    """Gradient accumulation over four micro-batches, the third fails inside a block entered
    with ``restore_on_error=True``: the step gets exactly the gradients of the three others, as
    plain PyTorch would."""
    model, opt, ref, ref_opt = _setup(half)
    trip = model[2]
    bad = 2
    opt.zero_grad()
    for seed in range(4):
        if seed != bad:
            with amp.scale_loss(_loss(model, seed), opt) as scaled:
                scaled.backward()
            continue
        with pytest.raises(Boom):
            trip.armed = where == "in_backward"
            with amp.scale_loss(_loss(model, seed), opt, restore_on_error=True) as scaled:
                if where == "before_backward":
                    raise Boom("bad batch before backward")
                scaled.backward()
                if where == "after_backward":
                    raise Boom("bad batch after backward")
        trip.armed = False
    ref_opt.zero_grad()
    for seed in range(4):
        if seed != bad:
            _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])
    opt.step()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), CHAIN_TOL[half])


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_failed_micro_batch_between_delayed_unscales(half):
    """The same with ``delay_unscale=True`` on all but the last micro-batch."""
    model, opt, ref, ref_opt = _setup(half)
    trip = model[2]
    opt.zero_grad()
    for seed in range(4):
        trip.armed = seed == 1
        if trip.armed:
            block = amp.scale_loss(_loss(model, seed), opt, restore_on_error=True)
            with pytest.raises(Boom), block as scaled:
                scaled.backward()
            continue
        with amp.scale_loss(_loss(model, seed), opt, delay_unscale=seed < 3) as scaled:
            scaled.backward()
    ref_opt.zero_grad()
    for seed in (0, 2, 3):
        _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])


@pytest.mark.parametrize("fails", [False, True], ids=["block_ends", "block_fails"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_zero_grad_in_the_block_drops_the_earlier_gradients(half, fails):
    """``zero_grad`` inside the block zeroes what came before, as in plain PyTorch (whether the
    block then fails or not)."""
    model, opt, ref, _ = _setup(half)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    if fails:
        with pytest.raises(Boom), amp.scale_loss(_loss(model, 1), opt) as scaled:
            opt.zero_grad()
            raise Boom("bad batch")
    else:
        with amp.scale_loss(_loss(model, 1), opt) as scaled:
            opt.zero_grad()
            scaled.backward()
        _loss(ref, 1).backward()
    with amp.scale_loss(_loss(model, 2), opt) as scaled:
        scaled.backward()
    _loss(ref, 2).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])


# ------------------------------------------------------------ optimizer.step() inside the block


@pytest.mark.parametrize("when", ["before_backward", "after_backward"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_step_inside_the_block_is_refused_with_the_fix(half, when):
    model, opt, ref, ref_opt = _setup(half)
    before = _weights(model)
    with (
        pytest.raises(RuntimeError, match=r"inside `with amp\.scale_loss.*after the with block"),
        amp.scale_loss(_loss(model, 0), opt) as scaled,
    ):
        if when == "after_backward":
            scaled.backward()
        opt.step()
    # Nothing moved, and the training goes on as if the block had not run.
    _check_close(_weights(model), before, dict(rtol=0, atol=0))
    with amp.scale_loss(_loss(model, 1), opt) as scaled:
        scaled.backward()
    opt.step()
    ref_opt.zero_grad()
    _loss(ref, 1).backward()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), CHAIN_TOL[half])


# ------------------------------------------------------------ nested blocks


@pytest.mark.parametrize("inner_loss_id", [0, 1])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_nested_blocks_for_one_optimizer_are_refused(half, inner_loss_id):
    model, opt, ref, _ = _setup(half, num_losses=2)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    with (
        pytest.raises(RuntimeError, match=r"already inside another.*Leave the first block"),
        amp.scale_loss(_loss(model, 1), opt, loss_id=0, restore_on_error=True) as outer,
    ):
        outer.backward(retain_graph=True)
        with amp.scale_loss(_loss(model, 2), opt, loss_id=inner_loss_id) as inner:
            inner.backward()
    # The refusal left the gradients of before the outer block (restored).
    _loss(ref, 0).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])


# ------------------------------------------------------------ delay_unscale across loss ids


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_delayed_loss_finished_under_another_loss_id_keeps_its_weight(half):
    """Loss 0 accumulates with delay_unscale, loss 1 finishes the step; the two scales differ
    (loss 1 overflowed once): each contribution is unscaled by its own scale."""
    model, opt, ref, ref_opt = _setup(half, num_losses=2, loss_scale="dynamic")
    opt.zero_grad()
    with amp.scale_loss(_loss(model, 9) * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()  # skipped; loss 1's scale is now half of loss 0's
    assert amp.skipped_steps(opt) == 1
    scales = amp.state_dict()
    assert scales["loss_scaler0"]["loss_scale"] == 2 * scales["loss_scaler1"]["loss_scale"]

    opt.zero_grad()
    with amp.scale_loss(_loss(model, 0), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(model, 1), opt, loss_id=1) as scaled:
        scaled.backward()
    _loss(ref, 0).backward()
    _loss(ref, 1).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])
    opt.step()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), CHAIN_TOL[half])
    assert amp.skipped_steps(opt) == 1


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_a_delayed_backward_after_an_unscaled_one_keeps_the_unscaled_gradients(half):
    """Unscaled, then delayed, then finishing backwards: each unscaled exactly once."""
    model, opt, ref, _ = _setup(half, loss_scale="dynamic")
    for seed, delay in ((0, False), (1, True), (2, False)):
        with amp.scale_loss(_loss(model, seed), opt, delay_unscale=delay) as scaled:
            scaled.backward()
        _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], CHAIN_TOL[half])
