"""Random sequences of what users do to weights, checked after each one against plain PyTorch.

Each case builds a small model (with or without a tied weight), an optimizer (SGD with momentum
or Adam) and a plain PyTorch twin trained on the same batches with the same optimizer: float32
while amp runs at O0, O1 or O2 (and after ``amp.close()``), the half dtype while amp runs at O3
(which trains the half weights themselves). Then a seeded random sequence of operations
(:data:`OPERATIONS`: steps, deep copies, in-place edits, checkpoint round trips, close and a new
``amp.initialize`` at a random level, a step whose second micro-batch raises inside
``amp.scale_loss``) runs, and after each one:

* ``state_dict()`` of the model and the twin's agree, and so do their forward outputs (within
  the rounding of the half model);
* there is one truth per weight: under every name of every param, ``state_dict()`` holds
  exactly what the optimizer steps (the fp32 master under O2, the param itself otherwise), and
  the model's param is that value rounded to its dtype.

An operation is a function of the :class:`World` and a random generator, registered in
:data:`OPERATIONS` with a weight: one more kind of user action is one more entry.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES
from torch import nn

from _amp_core_helpers import batch
from amp_core import amp

LEVELS = ["O0", "O1", "O2", "O3"]
N_OPERATIONS = 14
# Rounding of the half model against the twin, over a few steps (forward and weights).
TOL = {
    torch.float16: dict(rtol=2e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=8e-2, atol=6e-2),
}


class Net(nn.Module):
    def __init__(self, tied: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.02, eps=1e-3)


def _to_dtype(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Cast a plain model and its optimizer's floating state (but ``step``), as a
    ``load_state_dict`` into a model of that dtype would."""
    model.to(dtype)
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                state[key] = value.to(dtype)


@dataclass
class World:
    """The amp run and its plain PyTorch twin."""

    half: torch.dtype
    tied: bool
    opt_kind: str
    model: nn.Module
    opt: torch.optim.Optimizer
    twin: nn.Module
    twin_opt: torch.optim.Optimizer
    level: str | None  # None: amp closed, plain PyTorch training
    seed: int = 100

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def initialize(self, level: str) -> None:
        self.model, self.opt = amp.initialize(
            self.model, self.opt, opt_level=level, half_dtype=self.half, verbosity=0
        )
        self.level = level
        _to_dtype(self.twin, self.twin_opt, self.half if level == "O3" else torch.float32)

    def stepped(self) -> dict[int, torch.Tensor]:
        """What the optimizer steps for each model param, by the param's id."""
        params = list(self.model.parameters())
        views = amp.master_params(self.opt) if self.level is not None else params
        return {id(p): v for p, v in zip(params, views, strict=True)}


def _build(rng: random.Random, half: torch.dtype) -> World:
    tied = rng.random() < 0.5
    opt_kind = rng.choice(["sgd", "adam"])
    model = Net(tied, seed=0)
    twin = copy.deepcopy(model)
    world = World(
        half,
        tied,
        opt_kind,
        model,
        _make_optimizer(opt_kind, model.parameters()),
        twin,
        _make_optimizer(opt_kind, twin.parameters()),
        None,
    )
    world.initialize(rng.choice(LEVELS))
    return world


# ---------------------------------------------------------------- operations


def _step(world: World, bad_microbatch: str | None = None) -> None:
    """One training step of the model and its twin on the same batch. With ``bad_microbatch``
    (``"before"`` or ``"after"`` its backward), a second micro-batch raises inside
    ``amp.scale_loss`` and the loop skips it: the step takes the first one's gradients alone."""
    x, y = batch(world.next_seed(), din=4, dout=4)
    bad_x, bad_y = batch(world.next_seed(), din=4, dout=4)
    world.opt.zero_grad()
    loss = F.mse_loss(world.model(x).float(), y)
    skipped = 0
    if world.level is None:
        loss.backward()
        world.opt.step()
    else:
        with amp.scale_loss(loss, world.opt) as scaled:
            scaled.backward()
        if bad_microbatch is not None:
            bad_loss = F.mse_loss(world.model(bad_x).float(), bad_y)
            with (
                pytest.raises(RuntimeError, match="bad batch"),
                amp.scale_loss(bad_loss, world.opt, restore_on_error=True) as scaled,
            ):
                if bad_microbatch == "after":
                    scaled.backward()
                raise RuntimeError("bad batch")
        before = amp.skipped_steps(world.opt)
        world.opt.step()
        skipped = amp.skipped_steps(world.opt) - before
    if skipped:  # a dynamic loss scale found an overflow: the twin skips the step too
        return
    world.twin_opt.zero_grad()
    dtype = next(world.twin.parameters()).dtype
    F.mse_loss(world.twin(x.to(dtype)).float(), y).backward()
    world.twin_opt.step()


def op_step(world: World, rng: random.Random) -> None:
    _step(world)


def op_deepcopy(world: World, rng: random.Random) -> None:
    """An EMA copy: it computes what the model computes, exports its own weights, and an
    update written into its state_dict() values (timm's ModelEmaV2) reaches its weights."""
    ema = copy.deepcopy(world.model)
    x, _ = batch(world.next_seed(), din=4, dout=4)
    with torch.no_grad():
        assert torch.equal(ema(x), world.model(x))
        values = {v.data_ptr(): v for v in ema.state_dict().values()}  # a tied weight once
        for value in values.values():
            value.mul_(0.5)
        for p_ema, p in zip(ema.parameters(), world.model.parameters(), strict=True):
            assert torch.equal(p_ema, p * 0.5)
    exported = ema.state_dict()
    for name, p in ema.named_parameters(remove_duplicate=False):
        assert torch.equal(exported[name], p.detach()), name


def op_edit(world: World, rng: random.Random) -> None:
    """The same in-place edit (under no_grad) of one weight of the model and of the twin."""
    names = [n for n, _ in world.model.named_parameters()]
    name = rng.choice(names)
    kind = rng.choice(["zeros_", "fill_", "row", "copy_"])
    value = rng.uniform(-0.5, 0.5)
    for model in (world.model, world.twin):
        weight = model.get_parameter(name)
        with torch.no_grad():
            if kind == "zeros_":
                nn.init.zeros_(weight)
            elif kind == "fill_":
                weight.fill_(value)
            elif kind == "row":
                weight[0].fill_(value)
            else:
                weight.copy_(torch.full(weight.shape, value) + torch.arange(weight.shape[-1]))


def op_checkpoint(world: World, rng: random.Random) -> None:
    """Save model, optimizer and amp state dicts; resume in a fresh model and optimizer."""
    ckpt = {"model": world.model.state_dict(), "optimizer": world.opt.state_dict()}
    if world.level is not None:
        ckpt["amp"] = amp.state_dict()
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    world.model = Net(world.tied, seed=world.next_seed())
    world.opt = _make_optimizer(world.opt_kind, world.model.parameters())
    if world.level is not None:
        amp.close()
        world.model, world.opt = amp.initialize(
            world.model, world.opt, opt_level=world.level, half_dtype=world.half, verbosity=0
        )
    world.model.load_state_dict(ckpt["model"])
    world.opt.load_state_dict(ckpt["optimizer"])
    if world.level is not None:
        amp.load_state_dict(ckpt["amp"])


def op_failed_microbatch(world: World, rng: random.Random) -> None:
    """A step whose second micro-batch raises inside ``amp.scale_loss`` (before or after its
    backward), as a loop that skips a bad batch sees it."""
    _step(world, bad_microbatch=rng.choice(["before", "after"]))


def op_close(world: World, rng: random.Random) -> None:
    """amp.close(); then plain PyTorch training, or amp.initialize again at a random level."""
    if world.level is not None:
        amp.close()
        world.level = None
        _to_dtype(world.twin, world.twin_opt, torch.float32)  # close() widens an O3 model
    if rng.random() < 0.6:
        world.initialize(rng.choice(LEVELS))


# name -> (operation, weight in the random choice)
OPERATIONS: dict[str, tuple[Callable[[World, random.Random], None], float]] = {
    "step": (op_step, 4.0),
    "deepcopy": (op_deepcopy, 1.0),
    "edit": (op_edit, 1.5),
    "checkpoint": (op_checkpoint, 1.0),
    "close": (op_close, 1.0),
    "failed_microbatch": (op_failed_microbatch, 1.0),
}


# ---------------------------------------------------------------- the invariants


def check(world: World, history: list[str]) -> None:
    where = f"after {history}"
    tol = TOL[world.half]
    exported = world.model.state_dict()
    expected = world.twin.state_dict()
    assert exported.keys() == expected.keys(), where
    for key, value in expected.items():
        torch.testing.assert_close(
            exported[key].float(), value.float(), **tol, msg=lambda m, k=key: f"{k} {where}: {m}"
        )
    # One truth per weight: every name exports what the optimizer steps.
    stepped = world.stepped()
    for name, p in world.model.named_parameters(remove_duplicate=False):
        truth = stepped[id(p)].detach()
        assert torch.equal(exported[name], truth.to(exported[name].dtype)), f"{name} {where}"
        assert torch.equal(p.detach(), truth.to(p.dtype)), f"{name} {where}"
    x, _ = batch(0, din=4, dout=4)
    with torch.no_grad():
        out = world.model(x).float()
        ref = world.twin(x.to(next(world.twin.parameters()).dtype)).float()
    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"forward {where}: {m}")


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("case", range(12))
def test_random_weight_lifecycles_agree_with_plain_pytorch(case, half):
    rng = random.Random(1000 * case + (half == torch.float16))
    world = _build(rng, half)
    history = [f"initialize {world.level} tied={world.tied} {world.opt_kind}"]
    check(world, history)
    names = list(OPERATIONS)
    weights = [OPERATIONS[n][1] for n in names]
    for _ in range(N_OPERATIONS):
        name = rng.choices(names, weights)[0]
        OPERATIONS[name][0](world, rng)
        history.append(name if name != "close" else f"close->{world.level}")
        check(world, history)
