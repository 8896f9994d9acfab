"""What happens inside ``with amp.scale_loss(...)``: exceptions, ``step()`` and nested blocks.

Every expected gradient comes from a plain float32 PyTorch twin of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES
from torch import nn

from _amp_core_helpers import MasterAdam, batch, tiny_mlp
from amp_core import amp
from amp_core._optimizer import optimizer_state

LEVELS = ["O0", "O1", "O2", "O3"]
# A torch optimizer at every level, and at O2 an Adam that keeps the masters itself (amp-core's
# FusedMasterWeightOptimizer protocol, in plain PyTorch: MasterAdam), which takes the fused
# master-weight path. The same blocks with amp_optimizers.FusedAdam (another package)
# are in tests/integration/test_scale_loss_block_fused_adam.py.
OPTIMIZERS = [
    pytest.param("O0", "sgd", id="O0-sgd"),
    pytest.param("O1", "sgd", id="O1-sgd"),
    pytest.param("O2", "sgd", id="O2-sgd"),
    pytest.param("O3", "sgd", id="O3-sgd"),
    pytest.param("O2", "master_adam", id="O2-master_adam"),
]


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


def _optimizer(kind: str, params, lr: float = 0.1) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return MasterAdam(params, lr=lr, eps=ADAM_EPS)


def _reference_optimizer(kind: str, params, lr: float = 0.1) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, eps=ADAM_EPS)


def _setup(opt_level: str, half: torch.dtype, kind: str = "sgd", **kwargs):
    model = _net()
    ref = copy.deepcopy(model)
    opt = _optimizer(kind, model.parameters())
    ref_opt = _reference_optimizer(kind, ref.parameters())
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kwargs
    )
    state = optimizer_state(opt)
    assert state is not None and state.fused == (kind == "master_adam")
    return model, opt, ref, ref_opt


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    return F.mse_loss(model(x).float(), y)


def _grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in amp.master_params(opt)]


def _tol(opt_level: str, half: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-5, atol=1e-6) if opt_level == "O0" else CHAIN_TOL[half]


def _check_close(got: list[torch.Tensor], expected: list[torch.Tensor], tol) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tol)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


# ------------------------------------------------------------ an exception inside the block


@pytest.mark.parametrize("where", ["in_backward", "after_backward", "before_backward"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_a_failed_micro_batch_leaves_the_other_micro_batches_gradients(
    opt_level, kind, half, where
):
    """Gradient accumulation over four micro-batches, the third fails inside a block entered
    with ``restore_on_error=True``: the step gets exactly the gradients of the three others, as
    plain PyTorch would."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
    trip = model[2]
    state = optimizer_state(opt)
    assert state is not None
    bad = 2
    opt.zero_grad()
    for seed in range(4):
        if seed != bad:
            with amp.scale_loss(_loss(model, seed), opt) as scaled:
                scaled.backward()
            continue
        stage = state.stage
        with pytest.raises(Boom):
            trip.armed = where == "in_backward"
            with amp.scale_loss(_loss(model, seed), opt, restore_on_error=True) as scaled:
                if where == "before_backward":
                    raise Boom("bad batch before backward")
                scaled.backward()
                if where == "after_backward":
                    raise Boom("bad batch after backward")
        trip.armed = False
        assert state.stage is stage
    ref_opt.zero_grad()
    for seed in range(4):
        if seed != bad:
            _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))
    opt.step()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), _tol(opt_level, half))


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_a_failed_micro_batch_between_delayed_unscales(opt_level, kind, half):
    """The same with ``delay_unscale=True`` on all but the last micro-batch."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
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
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))


@pytest.mark.parametrize("delay", [False, True], ids=["unscaled", "delay_unscale"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_a_failed_block_after_others_refuses_the_step_until_zero_grad(opt_level, kind, half, delay):
    """Without ``restore_on_error``, a backward that fails after earlier micro-batches leaves
    their gradients mixed with part of its own: ``step()`` and the next block refuse with the
    fix, and ``zero_grad()`` starts over cleanly."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
    trip = model[2]
    before = _weights(model)
    with amp.scale_loss(_loss(model, 0), opt, delay_unscale=delay) as scaled:
        scaled.backward()
    trip.armed = True
    with pytest.raises(Boom), amp.scale_loss(_loss(model, 1), opt) as scaled:
        scaled.backward()
    trip.armed = False
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) got .* interrupted .*zero_grad"):
        opt.step()
    with (
        pytest.raises(RuntimeError, match=r"amp\.scale_loss got .* restore_on_error=True"),
        amp.scale_loss(_loss(model, 2), opt) as scaled,
    ):
        scaled.backward()
    _check_close(_weights(model), before, dict(rtol=0, atol=0))  # nothing stepped
    opt.zero_grad()
    with amp.scale_loss(_loss(model, 2), opt) as scaled:
        scaled.backward()
    ref_opt.zero_grad()
    _loss(ref, 2).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))
    opt.step()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), _tol(opt_level, half))


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_a_failed_first_block_leaves_no_gradient(opt_level, kind, half):
    """With no gradient in place at the entry, a failed block drops what its backward made
    (no copy needed): the next micro-batches accumulate as if it never ran."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
    trip = model[2]
    trip.armed = True
    with pytest.raises(Boom), amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    trip.armed = False
    assert all(p.grad is None for p in amp.master_params(opt))
    for seed in (1, 2):
        with amp.scale_loss(_loss(model, seed), opt) as scaled:
            scaled.backward()
        _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))
    opt.step()
    ref_opt.step()
    _check_close(_weights(model), _weights(ref), _tol(opt_level, half))


@pytest.mark.parametrize("fails", [False, True], ids=["block_ends", "block_fails"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_zero_grad_in_the_block_drops_the_earlier_gradients(opt_level, kind, half, fails):
    """``zero_grad`` inside the block zeroes what came before, as in plain PyTorch (whether the
    block then fails or not)."""
    model, opt, ref, _ = _setup(opt_level, half, kind)
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
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))


# ------------------------------------------------------------ optimizer.step() inside the block


@pytest.mark.parametrize("when", ["before_backward", "after_backward"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_step_inside_the_block_is_refused_with_the_fix(opt_level, kind, half, when):
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
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
    _check_close(_weights(model), _weights(ref), _tol(opt_level, half))


def _two_models(opt_level: str, half: torch.dtype, num_losses: int = 1):
    """Two models and their optimizers from one amp.initialize, and their fp32 twins."""
    a, b = tiny_mlp(0), tiny_mlp(1)
    refs = copy.deepcopy(a), copy.deepcopy(b)
    opts = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    # A static scale that cannot overflow here: no step of the twins is skipped.
    scale = {} if opt_level == "O0" or half == torch.bfloat16 else {"loss_scale": 1024.0}
    models, opts = amp.initialize(
        [a, b],
        list(opts),
        opt_level=opt_level,
        half_dtype=half,
        num_losses=num_losses,
        verbosity=0,
        **scale,
    )
    return models, opts, refs


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_stepping_another_optimizer_inside_the_block_is_fine(opt_level, half):
    (a, b), (opt_a, opt_b), (ref_a, ref_b) = _two_models(opt_level, half)
    with amp.scale_loss(_loss(b, 0), opt_b) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(a, 1), opt_a) as scaled:
        scaled.backward()
        opt_b.step()  # not part of this block
    opt_a.step()
    ref_opt_a = torch.optim.SGD(ref_a.parameters(), lr=0.1)
    ref_opt_b = torch.optim.SGD(ref_b.parameters(), lr=0.1)
    _loss(ref_b, 0).backward()
    ref_opt_b.step()
    _loss(ref_a, 1).backward()
    ref_opt_a.step()
    _check_close(_weights(a), _weights(ref_a), _tol(opt_level, half))
    _check_close(_weights(b), _weights(ref_b), _tol(opt_level, half))


# ------------------------------------------------------------ nested blocks


@pytest.mark.parametrize("inner_loss_id", [0, 1])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_nested_blocks_for_one_optimizer_are_refused(opt_level, kind, half, inner_loss_id):
    model, opt, ref, _ = _setup(opt_level, half, kind, num_losses=2)
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
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_nested_blocks_for_two_optimizers_keep_both_gradients(opt_level, half):
    (a, b), (opt_a, opt_b), (ref_a, ref_b) = _two_models(opt_level, half, num_losses=2)
    for step in range(2):
        with amp.scale_loss(_loss(a, step), opt_a, loss_id=0) as outer:
            with amp.scale_loss(_loss(b, step), opt_b, loss_id=1) as inner:
                inner.backward()
            outer.backward()
    _loss(ref_a, 0).backward()
    _loss(ref_a, 1).backward()
    _loss(ref_b, 0).backward()
    _loss(ref_b, 1).backward()
    _check_close(_grads(opt_a), [p.grad for p in ref_a.parameters()], _tol(opt_level, half))
    _check_close(_grads(opt_b), [p.grad for p in ref_b.parameters()], _tol(opt_level, half))


# ------------------------------------------------------------ delay_unscale across loss ids


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize(
    "opt_level, kind",
    [
        pytest.param("O1", "sgd", id="O1-sgd"),
        pytest.param("O2", "sgd", id="O2-sgd"),
        pytest.param("O2", "master_adam", id="O2-master_adam"),
    ],
)
def test_a_delayed_loss_finished_under_another_loss_id_keeps_its_weight(opt_level, kind, half):
    """Loss 0 accumulates with delay_unscale, loss 1 finishes the step; the two scales differ
    (loss 1 overflowed once): each contribution is unscaled by its own scale."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind, num_losses=2, loss_scale="dynamic")
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
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_a_delayed_backward_after_an_unscaled_one_keeps_the_unscaled_gradients(
    opt_level, kind, half
):
    """Unscaled, then delayed, then finishing backwards: each unscaled exactly once."""
    scale = {} if opt_level in ("O0", "O3") else {"loss_scale": "dynamic"}
    model, opt, ref, _ = _setup(opt_level, half, kind, **scale)
    for seed, delay in ((0, False), (1, True), (2, False)):
        with amp.scale_loss(_loss(model, seed), opt, delay_unscale=delay) as scaled:
            scaled.backward()
        _loss(ref, seed).backward()
    _check_close(_grads(opt), [p.grad for p in ref.parameters()], _tol(opt_level, half))


# ------------------------------------------------------------ amp.close() and the block


@pytest.mark.parametrize("delay", [False, True], ids=["unscaled", "delay_unscale"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level, kind", OPTIMIZERS)
def test_close_inside_the_block_is_refused_and_after_it_leaves_unscaled_grads(
    opt_level, kind, half, delay
):
    """``amp.close()`` inside the block would leave gradients multiplied by the loss scale for
    a plain step: refused with the fix, nothing changed. After the block (also one that delayed
    its unscale) the plain step that follows close() takes the plain PyTorch step."""
    model, opt, ref, ref_opt = _setup(opt_level, half, kind)
    with amp.scale_loss(_loss(model, 0), opt, delay_unscale=delay) as scaled:
        scaled.backward()
        with pytest.raises(RuntimeError, match=r"amp\.close\(\) was called inside .*after the"):
            amp.close()
        assert optimizer_state(opt) is not None  # still amp's
    amp.close()
    ref_opt.zero_grad()
    _loss(ref, 0).backward()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert got.grad is not None
        torch.testing.assert_close(got.grad.float(), want.grad, **_tol(opt_level, half))
