"""The fused optimizers under amp-core's ``amp.initialize``: O1, O2 and O3, on CPU.

Under O2, :class:`FusedAdam` implements amp-core's fused master-weight protocol: the optimizer
keeps the float32 masters in its state and its param groups keep the model's half params; the
gradients stay scaled at ``scale_loss`` exit and ``optimizer.step()`` unscales them, checks them
for inf/nan, steps the masters and writes the half params in one pass. The other optimizers get
the ordinary O2 path (amp's own float32 masters in their param groups).

The oracle of the O2 tests is the ordinary O2 path run with ``torch.optim.AdamW`` (same
hyperparameters, same model, same batches). Both paths feed the masters the same float32
gradients (the half gradients times the same inverse scale), so they differ by:

* the float32 rounding of two implementations of the Adam update, a few ulps of the masters per
  step: masters agree within :data:`MASTER_ATOL`;
* the half rounding of the model copy: each half param is its master rounded to nearest, so two
  masters that agree within :data:`MASTER_ATOL` give half params equal or one half ulp apart
  (``rtol = finfo(half).eps``), and a one-ulp difference feeds back only into later gradients.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from amp_test_support import HALF_DTYPES
from torch import Tensor, nn

from _amp_optimizers_helpers import assert_bitwise_equal
from amp_core import amp
from amp_optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

# |fused - ordinary| of the fp32 masters after the steps of a test (the registry's FP32_ATOL).
MASTER_ATOL = 1e-5
# Caps the dynamic scale (Apex starts at 2**16) so that fp16 gradients of scale ~1 never
# overflow by themselves: only the injected infs skip a step.
MAX_SCALE = 2.0**12
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)

Batch = tuple[Tensor, Tensor]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tensors of a few hundred elements: intra-op threads only add hand-offs, which dominate
    # the run time on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- model, data and steps ------------------------------------------------------------------------


def make_model(seed: int = 0) -> nn.Module:
    """Linear -> ReLU -> BatchNorm -> Linear: under O2 the Linears are half, the BatchNorm fp32.

    (BatchNorm after the ReLU: right after a Linear it would make that Linear's bias gradient
    zero up to rounding, which Adam's normalized update turns into steps of random sign.)
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))


def make_batch(step: int, n: int = 16) -> Batch:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def loss_fn(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def o2(
    half: torch.dtype, *, fused: bool, seed: int = 0, **amp_kwargs: Any
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model under O2 with FusedAdam (fused path) or torch's AdamW (ordinary path)."""
    model = make_model(seed)
    opt_cls = FusedAdam if fused else torch.optim.AdamW
    optimizer = opt_cls(model.parameters(), **ADAM)  # type: ignore[arg-type]
    amp_kwargs.setdefault("max_loss_scale", MAX_SCALE)
    return amp.initialize(  # type: ignore[no-any-return]
        model, optimizer, opt_level="O2", half_dtype=half, verbosity=0, **amp_kwargs
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    after_backward: Callable[[], None] | None = None,
) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model, batch)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        if after_backward is not None:
            after_backward()
    optimizer.step()
    return loss.item()


def masters(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p.detach().clone() for p in amp.master_params(optimizer)]


def moments(optimizer: torch.optim.Optimizer, key: str) -> list[Tensor]:
    # FusedAdam keys its state by the model's params, the ordinary path by amp's masters.
    return [optimizer.state[p][key].clone() for g in optimizer.param_groups for p in g["params"]]


def model_params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def max_abs_diff(actual: list[Tensor], expected: list[Tensor]) -> float:
    return max(
        (a.float() - e.float()).abs().max().item() for a, e in zip(actual, expected, strict=True)
    )


def assert_paths_agree(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ref_model: nn.Module,
    ref: Any,
    master_atol: float = MASTER_ATOL,
) -> None:
    """The fused run against the ordinary one, within the tolerances of the module docstring."""
    fused_masters, ref_masters = masters(optimizer), masters(ref)
    assert [m.dtype for m in fused_masters] == [torch.float32] * len(fused_masters)
    assert max_abs_diff(fused_masters, ref_masters) <= master_atol
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert p.dtype == r.dtype
        torch.testing.assert_close(p, r, rtol=torch.finfo(p.dtype).eps, atol=master_atol)
    # The moments hold the unscaled gradients (Adam's update alone would hide a constant factor
    # such as a forgotten loss scale); half params one ulp apart change a gradient by about
    # one half eps, relative to the gradient's scale.
    eps = torch.finfo(next(iter(half_params(model))).dtype).eps
    for key in ("exp_avg", "exp_avg_sq"):
        for a, e in zip(moments(optimizer, key), moments(ref, key), strict=True):
            torch.testing.assert_close(a, e, rtol=eps, atol=eps * e.abs().max().item())


def half_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)]


# --- 1. the fused path tracks the ordinary O2 path ------------------------------------------------


@pytest.mark.parametrize(
    "loss_scale", [None, "dynamic", 128.0], ids=["preset", "dynamic", "static"]
)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_tracks_the_ordinary_o2_path(half: torch.dtype, loss_scale: Any) -> None:
    model, opt = o2(half, fused=True, loss_scale=loss_scale)
    ref_model, ref = o2(half, fused=False, loss_scale=loss_scale)

    # The fused path: FusedAdam steps the model's own params and keeps float32 masters in its
    # state (the ordinary path puts amp's float32 masters in the param groups).
    halves = half_params(model)
    assert [p.dtype for p in halves] == [half] * 4  # the two Linears
    assert all(m.weight.dtype == torch.float32 for m in model if isinstance(m, nn.BatchNorm1d))
    assert all(
        p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters(), strict=True)
    )
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in halves)
    assert all(p.dtype == torch.float32 for p in ref.param_groups[0]["params"])
    # The masters start from the model's float32 values, not from the half-rounded ones.
    assert max_abs_diff(masters(opt), model_params(make_model())) == 0.0

    steps = 8
    for step in range(steps):
        train_step(model, opt, make_batch(step))
        train_step(ref_model, ref, make_batch(step))
        # The one-pass write: every half param is its master rounded to nearest.
        for p in halves:
            assert torch.equal(p, opt.state[p]["master_param"].to(half))

    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 0
    assert max_abs_diff(masters(opt), model_params(make_model())) > 1e-2  # it did train
    # Apex's Adam (the fused path) and torch.optim.AdamW round differently; once a master
    # crosses a half rounding boundary on one path only, the half params one ulp apart change
    # later gradients, and each step can add about 2 * eps(half) * lr (as in the accumulation
    # test below). The pure-PyTorch reference path of amp_C shows 1.8e-5 here for float16.
    accum_atol = MASTER_ATOL + steps * 2 * torch.finfo(half).eps * ADAM["lr"]
    assert_paths_agree(model, opt, ref_model, ref, master_atol=accum_atol)


# --- 2. an inf skips the step ---------------------------------------------------------------------


def _full_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "params": model_params(model),
            "masters": masters(optimizer),
            "state": optimizer.state_dict()["state"],
            "steps": [g["step"] for g in optimizer.param_groups],
        }
    )


@pytest.mark.parametrize("where", ["half_param", "fp32_param"])
@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0], ids=["dynamic", "static"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_skips_a_step_with_an_inf_gradient(
    half: torch.dtype, loss_scale: Any, where: str
) -> None:
    model, opt = o2(half, fused=True, loss_scale=loss_scale)
    for step in range(3):
        train_step(model, opt, make_batch(step))
    before = _full_snapshot(model, opt)
    scale_before = amp.state_dict()["loss_scaler0"]["loss_scale"]
    assert scale_before == (MAX_SCALE if loss_scale == "dynamic" else 128.0)
    # A Linear weight (half, stepped through its master) or the BatchNorm weight (fp32, stepped
    # in place): an inf in either skips the whole step.
    target = model[3].weight if where == "half_param" else model[2].weight

    def inject() -> None:
        assert target.grad is not None
        target.grad.view(-1)[5] = float("inf")

    train_step(model, opt, make_batch(3), after_backward=inject)

    assert_bitwise_equal(_full_snapshot(model, opt), before)
    assert [float(g["step"]) for g in opt.param_groups] == [3.0]
    scale_after = amp.state_dict()["loss_scaler0"]["loss_scale"]
    if loss_scale == "dynamic":
        assert scale_after == scale_before / 2
        assert amp.skipped_steps(opt) == 1
    else:  # a static scale never reads the flag back: the step is skipped on the device
        assert scale_after == scale_before
    assert amp.skipped_steps(opt) == 1

    # The next finite step is taken, at the (new) scale.
    train_step(model, opt, make_batch(4))
    assert [float(g["step"]) for g in opt.param_groups] == [4.0]
    assert max_abs_diff(masters(opt), before["masters"]) > 0.0


# --- 3. master_params gives unscaled fp32 grads for clipping --------------------------------------


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_master_params_gives_unscaled_grads_for_clipping(half: torch.dtype) -> None:
    fp32_twin = make_model()
    model, opt = o2(half, fused=True, loss_scale="dynamic")
    ref_model, ref = o2(half, fused=False, loss_scale="dynamic")
    max_norm = 0.5
    clipped = 0

    for step in range(6):
        batch = make_batch(step)
        grads, norms = [], []
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            with amp.scale_loss(loss_fn(m, batch), o) as scaled_loss:
                scaled_loss.backward()
            params = list(amp.master_params(o))
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
            norms.append(nn.utils.clip_grad_norm_(params, max_norm))
            o.step()
        assert [g.dtype for g in grads[0]] == [torch.float32] * len(grads[0])
        clipped += int(norms[0].item() > max_norm)
        if step == 0:
            # Same half model, same half gradients, same inverse scale: the fused path's
            # master grads are the ordinary path's bit for bit (later steps may see half
            # params one ulp apart, see the module docstring).
            assert_bitwise_equal(grads[0], grads[1])
            assert torch.equal(norms[0], norms[1])
            # Unscaled (the scale was 4096): the float32 model's gradient norm, up to the
            # half rounding of the forward and backward.
            fp32_twin.zero_grad()
            loss_fn(fp32_twin, batch).backward()
            twin_norm = nn.utils.get_total_norm([p.grad for p in fp32_twin.parameters()])
            assert abs(norms[0].item() / twin_norm.item() - 1.0) < 0.05

    assert clipped >= 3  # the clipping was active
    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 0
    assert_paths_agree(model, opt, ref_model, ref)


# --- 4. gradient accumulation with delay_unscale --------------------------------------------------


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_accumulation_with_delay_unscale(half: torch.dtype) -> None:
    micro, steps = 3, 3
    model, opt = o2(half, fused=True, loss_scale="dynamic")
    ref_model, ref = o2(half, fused=False, loss_scale="dynamic")

    for step in range(steps):
        batches = [make_batch(micro * step + i) for i in range(micro)]
        opt.zero_grad()
        for i, batch in enumerate(batches):
            with amp.scale_loss(loss_fn(model, batch), opt, delay_unscale=i < micro - 1) as s:
                s.backward()
        opt.step()
        # The oracle: one backward of the summed loss, one step, on the ordinary path.
        ref.zero_grad()
        total = sum((loss_fn(ref_model, b) for b in batches), torch.zeros(()))
        with amp.scale_loss(total, ref) as s:
            s.backward()
        ref.step()
        if step == 0:
            # exp_avg = (1 - beta1) * g and exp_avg_sq = (1 - beta2) * g**2 after one step:
            # the accumulated, unscaled gradient. It differs from the summed loss's by the
            # order of the half additions (the micro-batch gradients are summed in half
            # precision, across backward calls here and inside one backward there).
            eps = torch.finfo(half).eps
            for key in ("exp_avg", "exp_avg_sq"):
                for a, e in zip(moments(opt, key), moments(ref, key), strict=True):
                    scale = e.abs().max().item()
                    torch.testing.assert_close(a, e, rtol=2 * eps, atol=2 * eps * scale)

    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 0
    assert [float(g["step"]) for g in opt.param_groups] == [float(steps)]
    # Adam's update is at most about lr per element, and a relative gradient error r changes it
    # by about 2 * r * lr: each step adds that on top of the masters' float32 rounding.
    accum_atol = MASTER_ATOL + steps * 2 * torch.finfo(half).eps * ADAM["lr"]
    assert max_abs_diff(masters(opt), masters(ref)) <= accum_atol
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=torch.finfo(p.dtype).eps, atol=accum_atol)


# --- 4b. gradients after a step -------------------------------------------------------------------
# As Apex's O2 did, every step (taken or skipped) drops the masters' gradients, on both paths:
# model.zero_grad() cannot reach them, so a loop that clears only the model's gradients (the
# transformers Trainer does) must still start each step clean. The fp32 params are the model's
# own and keep their gradients until zeroed, as in any PyTorch loop.


def _backward(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    with amp.scale_loss(loss_fn(model, make_batch(step)), optimizer) as scaled_loss:
        scaled_loss.backward()


def _master_grads(optimizer: torch.optim.Optimizer) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in amp.master_params(optimizer)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ordinary"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_step_drops_the_master_grads(half: torch.dtype, fused: bool) -> None:
    model, opt = o2(half, fused=fused, loss_scale="dynamic")
    fp32_params = {id(p) for p in model.parameters() if p.dtype == torch.float32}
    for step in range(2):
        opt.zero_grad()
        _backward(model, opt, step)
        assert all(g is not None for g in _master_grads(opt))
        opt.step()
        for p in amp.master_params(opt):
            if id(p) in fp32_params:
                assert p.grad is not None  # the model's own fp32 params: kept until zeroed
            else:
                assert p.grad is None
        assert all(p.grad is None for p in half_params(model))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ordinary"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_loop_clearing_only_the_model_grads_equals_optimizer_zero_grad(
    half: torch.dtype, fused: bool
) -> None:
    # What the transformers Trainer does: model.zero_grad() only, never optimizer.zero_grad().
    model, opt = o2(half, fused=fused, loss_scale="dynamic")
    ref_model, ref = o2(half, fused=fused, loss_scale="dynamic")
    for step in range(5):

        def inject(m: nn.Module = model) -> None:
            m[0].weight.grad.view(-1)[1] = float("inf")  # type: ignore[union-attr]

        model.zero_grad()
        loss = loss_fn(model, make_batch(step))
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
            if step == 2:
                inject()
        opt.step()
        train_step(
            ref_model, ref, make_batch(step), (lambda: inject(ref_model)) if step == 2 else None
        )
    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 1
    assert_bitwise_equal(model_params(model), model_params(ref_model))
    assert_bitwise_equal(masters(opt), masters(ref))
    assert_bitwise_equal(opt.state_dict(), ref.state_dict())


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_without_zero_grad_matches_the_ordinary_path(half: torch.dtype) -> None:
    # No zero_grad at all: each step reads the last backward's half grads alone (the masters'
    # grads were dropped) and the fp32 params' accumulated grads, on both paths.
    model, opt = o2(half, fused=True, loss_scale="dynamic")
    ref_model, ref = o2(half, fused=False, loss_scale="dynamic")
    for step in range(4):
        for m, o in ((model, opt), (ref_model, ref)):
            _backward(m, o, step)
            o.step()
    _backward(model, opt, 4)
    _backward(ref_model, ref, 4)
    grads, ref_grads = _master_grads(opt), _master_grads(ref)
    eps = torch.finfo(half).eps
    for g, r in zip(grads, ref_grads, strict=True):
        assert g is not None and r is not None
        torch.testing.assert_close(g, r, rtol=eps, atol=eps * r.abs().max().item())
    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 0
    assert_paths_agree(model, opt, ref_model, ref)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_master_params_before_a_step_and_a_second_step(half: torch.dtype) -> None:
    model, opt = o2(half, fused=True, loss_scale="dynamic")
    ref_model, ref = o2(half, fused=False, loss_scale="dynamic")
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        _backward(m, o, 0)
    # Before the step: the unscaled float32 gradients the step will read (bitwise: same half
    # gradients, same inverse scale), for the half params' masters and the fp32 BatchNorm.
    assert_bitwise_equal(_master_grads(opt), _master_grads(ref))
    opt.step()
    ref.step()
    # A second step without a new backward: the masters have no gradient left, the fp32
    # params step again with theirs.
    opt.step()
    ref.step()
    assert_paths_agree(model, opt, ref_model, ref)
    assert [float(g["step"]) for g in opt.param_groups] == [2.0]


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_adam_recovers_from_an_overflow_without_zero_grad(half: torch.dtype) -> None:
    # zero_grad, then an overflowed backward: the step is skipped and its gradients dropped,
    # so the next steps (no zero_grad) are taken, as on the ordinary path.
    ref_model, ref = o2(half, fused=False, loss_scale="dynamic")
    model, opt = o2(half, fused=True, loss_scale="dynamic")  # amp.state_dict() reads its scale
    for m, o in ((model, opt), (ref_model, ref)):
        train_step(m, o, make_batch(0))
        o.zero_grad()
        with amp.scale_loss(loss_fn(m, make_batch(1)), o) as scaled_loss:
            scaled_loss.backward()
            m[0].weight.grad.view(-1)[3] = float("inf")  # type: ignore[union-attr]
        o.step()
        before = masters(o)
        for step in range(2, 5):
            _backward(m, o, step)
            o.step()
        assert max_abs_diff(masters(o), before) > 1e-2  # trained on
        assert amp.skipped_steps(o) == 1
    assert [float(g["step"]) for g in opt.param_groups] == [4.0]
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == MAX_SCALE / 2
    assert_paths_agree(model, opt, ref_model, ref)


# --- 5. checkpoint resume -------------------------------------------------------------------------


def _o2_run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    overflow_at: int,
    clear: str = "optimizer",
) -> None:
    for step in steps:

        def inject() -> None:
            grad = model[0].weight.grad
            assert grad is not None
            grad.view(-1)[0] = float("nan")

        if clear == "optimizer":
            train_step(model, opt, make_batch(step), inject if step == overflow_at else None)
            continue
        model.zero_grad()  # the model's grads only, as the transformers Trainer does
        with amp.scale_loss(loss_fn(model, make_batch(step)), opt) as scaled_loss:
            scaled_loss.backward()
            if step == overflow_at:
                inject()
        opt.step()


@pytest.mark.parametrize(
    ("fused", "clear"),
    [(True, "optimizer"), (True, "model"), (False, "model")],
    ids=["fused-opt_zero_grad", "fused-model_zero_grad", "ordinary-model_zero_grad"],
)
@pytest.mark.parametrize("loss_scale", [None, "dynamic"], ids=["preset", "dynamic"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_checkpoint_resume_is_bitwise(
    half: torch.dtype, loss_scale: Any, fused: bool, clear: str
) -> None:
    # An overflow in the first half makes the saved dynamic scale differ from the initial one.
    total, k, overflow_at = 7, 4, 1
    model, opt = o2(half, fused=fused, loss_scale=loss_scale)
    _o2_run(model, opt, range(total), overflow_at, clear)
    expected = {
        "model": copy.deepcopy(model.state_dict()),
        "params": model_params(model),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "amp": amp.state_dict(),
    }

    model, opt = o2(half, fused=fused, loss_scale=loss_scale)
    _o2_run(model, opt, range(k), overflow_at, clear)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()},
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    if loss_scale == "dynamic":
        assert checkpoint["amp"]["loss_scaler0"]["loss_scale"] == MAX_SCALE / 2

    # Rebuilt from other random weights, then loaded in Apex's order.
    model, opt = o2(half, fused=fused, seed=1, loss_scale=loss_scale)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    _o2_run(model, opt, range(k, total), overflow_at, clear)

    assert_bitwise_equal(model_params(model), expected["params"])
    assert_bitwise_equal(model.state_dict(), expected["model"])  # fp32 masters, BN stats
    assert_bitwise_equal(opt.state_dict(), expected["optimizer"])
    assert amp.state_dict() == expected["amp"]


# --- 6. every optimizer at every opt level --------------------------------------------------------

OPTIMIZERS: list[Any] = [
    pytest.param(lambda ps: FusedAdam(ps, lr=2e-2), id="FusedAdam"),
    pytest.param(lambda ps: FusedSGD(ps, lr=5e-2, momentum=0.9), id="FusedSGD"),
    pytest.param(lambda ps: FusedLAMB(ps, lr=5e-2), id="FusedLAMB"),
    # NovoGrad normalizes each gradient by its tensor's norm: it needs a larger lr.
    pytest.param(lambda ps: FusedNovoGrad(ps, lr=1.0), id="FusedNovoGrad"),
    pytest.param(lambda ps: FusedAdagrad(ps, lr=5e-2), id="FusedAdagrad"),
]


def _regression_data() -> Batch:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=gen)
    w = torch.randn(8, 4, generator=gen) * 0.5
    return x, x @ w + 0.3


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("factory", OPTIMIZERS)
def test_every_optimizer_trains_at_every_opt_level(
    factory: Callable[[Any], torch.optim.Optimizer], half: torch.dtype, opt_level: str
) -> None:
    model = make_model()
    optimizer = factory(model.parameters())
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        half_dtype=half,
        verbosity=0,
        max_loss_scale=MAX_SCALE,
    )
    linears = [m for m in model if isinstance(m, nn.Linear)]
    bn_params = list(model[2].parameters())
    group_params = [p for g in optimizer.param_groups for p in g["params"]]
    stepped = list(amp.master_params(optimizer))

    # The dtypes amp promises for each level.
    if opt_level == "O1":  # fp32 model, stepped directly
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert all(p is q for p, q in zip(stepped, model.parameters(), strict=True))
    elif opt_level == "O2":  # half Linears, fp32 BatchNorm, fp32 masters stepped
        assert {p.dtype for m in linears for p in m.parameters()} == {half}
        assert {p.dtype for p in bn_params} == {torch.float32}
        assert {p.dtype for p in stepped} == {torch.float32}
        if isinstance(optimizer, FusedAdam):  # the fused path: the groups keep the model's
            assert all(p is q for p, q in zip(group_params, model.parameters(), strict=True))
        else:  # the ordinary path: amp's masters in the groups
            assert all(p is q for p, q in zip(group_params, stepped, strict=True))
            assert not any(s is p for s in stepped for p in linears[0].parameters())
    else:  # O3: everything half, stepped directly
        assert {p.dtype for p in model.parameters()} == {half}
        assert all(p is q for p, q in zip(stepped, model.parameters(), strict=True))

    batch = _regression_data()
    losses = [train_step(model, optimizer, batch) for _ in range(10)]

    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.6 * losses[0], losses
    assert amp.skipped_steps(optimizer) == 0
    # Dtypes unchanged by training.
    expected_model = {"O1": {torch.float32}, "O2": {half, torch.float32}, "O3": {half}}
    assert {p.dtype for p in model.parameters()} == expected_model[opt_level]


# --- 4c. the stage of the fused step --------------------------------------------------------------


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_step_after_delayed_unscale_names_the_fix(half: torch.dtype) -> None:
    model, opt = o2(half, fused=True, loss_scale="dynamic")
    with amp.scale_loss(loss_fn(model, make_batch(0)), opt, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(RuntimeError, match=r"delay_unscale=True.*delay_unscale=False"):
        opt.step()
    opt.zero_grad()  # the fix the error names
    with amp.scale_loss(loss_fn(model, make_batch(0)), opt) as s:
        s.backward()
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) without a closure"):
        opt.step(lambda: None)
    opt.step()
    assert amp.skipped_steps(opt) == 0


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_fused_delayed_backward_after_a_deferred_one(half: torch.dtype) -> None:
    # A backward whose grads wait scaled for the fused step, then a delayed one and a last one:
    # the waiting grads are unscaled before the delayed backward adds to them, so the step sees
    # the sum of the three micro-batches, as on the ordinary path.
    model, opt = o2(half, fused=True, loss_scale=64.0)
    ref_model, ref = o2(half, fused=False, loss_scale=64.0)
    for m, o in ((model, opt), (ref_model, ref)):
        for i, delay in enumerate((False, True, False)):
            with amp.scale_loss(loss_fn(m, make_batch(i)), o, delay_unscale=delay) as s:
                s.backward()
        o.step()
    assert amp.skipped_steps(opt) == amp.skipped_steps(ref) == 0
    eps = torch.finfo(half).eps
    for key in ("exp_avg", "exp_avg_sq"):
        for a, e in zip(moments(opt, key), moments(ref, key), strict=True):
            scale = e.abs().max().item()
            torch.testing.assert_close(a, e, rtol=4 * eps, atol=4 * eps * scale)


def test_close_gives_a_fused_o2_adam_back_its_own_step() -> None:
    """amp.close() undoes the fused master-weight path: FusedAdam steps the model's own
    params again (back in float32, with the masters' values), with no wrapper left on the
    instance."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = FusedAdam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    amp.close()
    assert not {"step", "zero_grad", "add_param_group", "_amp_state"} & set(opt.__dict__)
    assert opt.param_groups[0]["params"] == [model.weight, model.bias]
    assert model.weight.dtype == torch.float32 and model.bias.dtype == torch.float32
    before = model.weight.detach().clone()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    # Adam's first step moves every weight by about lr (sign of the gradient).
    torch.testing.assert_close(
        (model.weight.detach() - before).abs().float(),
        torch.full_like(before, 0.1, dtype=torch.float32),
        rtol=0.0,
        atol=1.6e-2,
    )
