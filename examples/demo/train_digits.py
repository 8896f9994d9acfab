"""Train a CNN on scikit-learn's digits under amp opt levels O0-O3: what each level costs and buys.

One model per opt level, all from the same initial weights and the same batch order, so the
only difference between the rows is the opt level. Runs on CUDA with float16 when a GPU is
present, otherwise on CPU with bfloat16. Reports, per level, the loss curve and final test
accuracy, the training-step time relative to O0 (interleaved rounds, with their spread), and
the memory held: weights + gradients + optimizer state, what autograd saves for backward, and
on CUDA the device's peak allocation. Writes one figure with three panels and prints a table.

Each level trains in a process of its own, because amp's O1 casting is process-wide (as in
Apex); the processes take turns, so only one computes at any time.

Before it trains, the demo says what the hardware does with half precision (see
digits_hardware.py), times a few steps of every level, and sizes the run to ``--budget``
seconds (150 on a CPU, 50 on a GPU): as many epochs and timed rounds as fit, up to the full
run (``--full``: 12 epochs, 15 rounds of 10 steps). A progress bar shows the time left.

Usage:
    python examples/demo/train_digits.py                        # sized to about 2.5 minutes
    python examples/demo/train_digits.py --full                 # the full run, however long
    python examples/demo/train_digits.py --levels O0 O2 --epochs 5 --device cpu
    python examples/demo/train_digits.py --smoke                # a quick look, for tests
    python examples/demo/train_digits.py --record               # the README's figure

Needs scikit-learn (the data set) and matplotlib (the plot): `nox -s demo` installs both.

Exits with status 1 when O1 or O2 ends more than 1 accuracy point below O0, and more than
the test set's resolution (a tie is no failure).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import math
import multiprocessing
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below

import digits_report
from digits_hardware import Machine, describe_machine
from digits_measure import (
    HeldMemory,
    LevelTiming,
    SavedForBackward,
    held_memory,
    summarize_rounds,
    unresolved_pairs,
)
from digits_plan import (
    LoadWatch,
    Plan,
    Progress,
    Size,
    accuracy_resolution,
    clock,
    load_warnings,
    plan_run,
)

from amp_core import amp

LOG = logging.getLogger("train_digits")

LEVELS = ("O0", "O1", "O2", "O3")
# O3 is pure half precision (no fp32 master weights, no fp32 batchnorm): reported, not checked.
CHECKED_LEVELS = ("O1", "O2")
MAX_DROP_POINTS = 1.0
O0_TARGET_ACCURACY = 95.0
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out" / "demo.png"
RECORD_DIR = HERE / "recorded"
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Epochs, timed rounds and steps per timed block of the full run and of --smoke.
FULL = Size(12, 15, 10)
SMOKE = Size(2, 5, 5)
# The whole run's default time budget in seconds, per device type (--budget).
BUDGET = {"cpu": 150.0, "cuda": 50.0}
# Seconds kept for what follows the sized part: the accuracy, the memory step, the figure.
RESERVE_SECONDS = 10.0
# Calibration: one untimed step per level (one-time set-up), then this many timed ones.
CALIBRATION_STEPS = 1


@dataclass(frozen=True)
class Split:
    """The fixed train/test split, already on the training device."""

    x_train: Tensor  # (N_train, 1, 8, 8) float32 in [0, 1]
    y_train: Tensor  # (N_train,) int64
    x_test: Tensor  # (N_test, 1, 8, 8)
    y_test: Tensor  # (N_test,)


@dataclass(frozen=True)
class RunConfig:
    """What every level's process needs to build its model, data and optimizer."""

    seed: int
    device: str
    half_dtype: str
    batch_size: int
    lr: float
    loss_scale: str | float | None
    threads: int | None
    width: int = 64


@dataclass
class LevelResult:
    """What one opt level produced."""

    level: str
    accuracy: float  # percent on the test split
    epoch_losses: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    timing: LevelTiming | None = None  # filled in once every round has run
    held: HeldMemory = field(default_factory=lambda: HeldMemory(0, 0, 0))
    saved_bytes: int = 0  # what autograd saves for backward, one batch
    step_peak_bytes: int = 0  # held + saved, at the step's largest checkpoint
    cuda_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated over the timed steps
    loss_scale: float = 1.0
    skipped: int = 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run; the demo times a few steps first and fits epochs and "
        f"timed rounds into it (default {BUDGET['cpu']:.0f} on a CPU, {BUDGET['cuda']:.0f} "
        "on a GPU)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the full run, however long it takes: {FULL.epochs} epochs, {FULL.rounds} timed "
        f"rounds of {FULL.steps} steps (a CPU without native bfloat16 needs about an hour)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per level (default: sized to --budget)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds; each runs every level once, in rotating order (default: sized)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per level and round (default: sized)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE.epochs} epochs, {SMOKE.rounds} rounds of {SMOKE.steps} steps; accuracy "
        "not checked (for tests)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"write the figure and JSON into {RECORD_DIR} (named after the kind of hardware) "
        "and the table into the demo's README",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument(
        "--out", type=Path, default=None, help=f"the figure (PNG); default {DEFAULT_OUT}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--width",
        type=int,
        default=64,
        help="channels of the CNN's first convolution; every layer scales with it (default 64: "
        "1.1 M parameters, where low precision pays; 8: 20 k parameters, for quick checks)",
    )
    parser.add_argument(
        "--loss-scale",
        type=loss_scale_arg,
        default=None,
        help='"dynamic" or a number; default: amp\'s per-level default (dynamic at O1/O2)',
    )
    parser.add_argument(
        "--half-dtype",
        choices=("auto", *HALF_DTYPES),
        default="auto",
        help="low precision type; auto = float16 on CUDA, bfloat16 on CPU",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per level (default: PyTorch's own choice; 1 when the load average "
        "is at or above the number of cores)",
    )
    args = parser.parse_args(argv)
    if args.record and args.smoke:
        parser.error("--record writes the README's figure from a real run; drop --smoke")
    if args.smoke and args.full:
        parser.error("--smoke and --full ask for opposite sizes; give one of them")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    names = ("epochs", "rounds", "steps")
    for name in names:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    # A size is fixed by --smoke, --full or any of --epochs/--rounds/--steps (the rest from
    # the full run); otherwise it is sized to the budget after the calibration steps.
    args.sized = not (args.smoke or args.full or any(getattr(args, n) for n in names))
    if args.sized:
        args.size = None
    else:
        defaults = SMOKE if args.smoke else FULL
        args.size = Size(*(getattr(args, n) or getattr(defaults, n) for n in names))
    if args.out is None and not args.record:  # --record: named after the hardware, in main
        args.out = DEFAULT_OUT
    return args


def loss_scale_arg(value: str) -> str | float:
    """argparse type of ``--loss-scale``: ``"dynamic"`` or a positive number."""
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except ValueError:
        scale = -1.0
    if not 0.0 < scale < float("inf"):
        raise argparse.ArgumentTypeError(
            f'must be "dynamic" or a positive number, got {value!r}; e.g. --loss-scale 128'
        )
    return scale


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    return torch.device(name)


def pick_half_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return HALF_DTYPES[name]


def load_split(seed: int, device: torch.device) -> Split:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise SystemExit(
            f"the demo loads scikit-learn's digits data set, but scikit-learn is missing ({exc}); "
            "install it with `pip install scikit-learn matplotlib`, or run `nox -s demo`"
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    return Split(x_train.to(device), y_train.to(device), x_test.to(device), y_test.to(device))


def make_model(width: int = 64) -> nn.Module:
    # Wide enough (1.1 M parameters, about 0.6 GFLOP per batch of 128 forward) that the step
    # is spent in convolutions and matrix products, where low precision can pay; a much
    # smaller CNN is all per-op overhead and runs alike at every level. BatchNorm layers are
    # what O2 keeps in fp32 (keep_batchnorm_fp32) and O3 does not.
    # ``width`` (the first convolution's channels, W) scales every layer; tests of accuracy
    # alone take a narrow one.
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False),  # (B, W, 8, 8)
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),  # (B, 2W, 8, 8)
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 2W, 4, 4)
        nn.Flatten(),  # (B, 32W)
        nn.Linear(32 * width, 8 * width),
        nn.ReLU(),
        nn.Linear(8 * width, 10),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor) -> Tensor:
    """One amp training step; returns the (unscaled) loss."""
    logits = model(x)  # (B, 10); amp returns fp32 under O2/O3
    loss = F.cross_entropy(logits.float(), y)
    optimizer.zero_grad()  # no set_to_none: Apex's O2 zero_grad takes no arguments
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()  # amp skips it when the gradients overflowed
    return loss.detach()


@torch.no_grad()
def test_accuracy(model: nn.Module, split: Split) -> float:
    model.eval()
    predicted = model(split.x_test).argmax(dim=1)
    model.train()
    return (predicted == split.y_test).float().mean().item() * 100.0


class LevelRun:
    """One opt level's model, optimizer and data, driven step by step by the main process."""

    def __init__(self, level: str, config: RunConfig) -> None:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.level = level
        self.device = pick_device(config.device)
        self.batch_size = config.batch_size
        self.split = load_split(config.seed, self.device)
        torch.manual_seed(config.seed)  # same initial weights for every level
        model = make_model(config.width).to(self.device)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.model, self.optimizer = amp.initialize(
            model,
            optimizer,
            opt_level=level,
            loss_scale=config.loss_scale,
            verbosity=0,
            half_dtype=pick_half_dtype(config.half_dtype, self.device),
        )
        self.model.train()
        self.generator = torch.Generator().manual_seed(config.seed)  # same batch order too
        self._timing_batch = 0
        self._peak_reset = False

    def threads(self) -> int:
        return torch.get_num_threads()

    def epoch(self) -> tuple[float, float]:
        """One pass over the training split: (mean training loss, seconds)."""
        sync(self.device)
        start = time.perf_counter()
        order = torch.randperm(len(self.split.y_train), generator=self.generator)
        batches = order.to(self.device).split(self.batch_size)
        total = torch.zeros((), device=self.device)
        for index in batches:
            total += train_step(
                self.model, self.optimizer, self.split.x_train[index], self.split.y_train[index]
            )
        mean = total.item() / len(batches)
        return mean, time.perf_counter() - start

    def accuracy(self) -> float:
        return test_accuracy(self.model, self.split)

    def _next_batch(self) -> tuple[Tensor, Tensor]:
        # Full batches, in the same order at every level: the timed steps do the same work.
        n = len(self.split.y_train)
        start = (self._timing_batch * self.batch_size) % (n - self.batch_size + 1)
        self._timing_batch += 1
        index = slice(start, start + self.batch_size)
        return self.split.x_train[index], self.split.y_train[index]

    def timed_steps(self, steps: int) -> float:
        """Seconds per step over ``steps`` training steps (the device synchronized)."""
        batches = [self._next_batch() for _ in range(steps)]
        if self.device.type == "cuda" and not self._peak_reset:
            torch.cuda.reset_peak_memory_stats(self.device)  # from the first (warm-up) block on
            self._peak_reset = True
        sync(self.device)
        start = time.perf_counter()
        for x, y in batches:
            train_step(self.model, self.optimizer, x, y)
        sync(self.device)
        return (time.perf_counter() - start) / steps

    def memory(self) -> dict[str, Any]:
        """What one training step holds, counted at its checkpoints.

        The checkpoints: the end of the forward (the tensors saved for backward are alive),
        after the backward, inside ``optimizer.step`` before and after the update (step
        hooks), and after the step. ``held`` is weights + gradients + optimizer state at the
        checkpoint where they are largest; ``step_peak`` adds what autograd saves for
        backward where it is alive.
        """
        held_now, weight_keys = held_memory(self.model, self.optimizer)
        checkpoints = [held_now]

        def look(*_: Any) -> None:
            checkpoints.append(held_memory(self.model, self.optimizer)[0])

        x, y = self._next_batch()
        with SavedForBackward(exclude=weight_keys) as saved:
            loss = F.cross_entropy(self.model(x).float(), y)
        at_forward_end = held_memory(self.model, self.optimizer)[0]
        checkpoints.append(at_forward_end)
        self.optimizer.zero_grad()
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        look()
        hooks = [
            self.optimizer.register_step_pre_hook(look),
            self.optimizer.register_step_post_hook(look),
        ]
        self.optimizer.step()
        for hook in hooks:
            hook.remove()
        look()
        held = max(checkpoints, key=lambda h: h.total)
        step_peak = max(at_forward_end.total + saved.bytes, held.total)
        peak = None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        scaler = amp.state_dict()["loss_scaler0"]
        return {
            "held": held,
            "saved_bytes": saved.bytes,
            "step_peak_bytes": step_peak,
            "cuda_peak_bytes": peak,
            "loss_scale": float(scaler["loss_scale"]),
            "skipped": amp.skipped_steps(self.optimizer),
        }


def _serve(level: str, config: RunConfig, conn: Connection) -> None:
    """A level's process: builds a LevelRun, then runs the method each message names."""
    try:
        run = LevelRun(level, config)
        conn.send(("ok", None))
        while True:
            name, args = conn.recv()
            if name == "stop":
                return
            conn.send(("ok", getattr(run, name)(*args)))
    except BaseException:  # report it to the main process, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class LevelProcess:
    """The main process's handle on one level's process."""

    def __init__(self, level: str, config: RunConfig) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter per level
        self.level = level
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(level, config, child), name=f"digits-{level}", daemon=True
        )
        self._process.start()
        child.close()

    def wait_ready(self) -> None:
        self._reply()

    def call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        return self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the {self.level} process exited (code {self._process.exitcode}) "
                "without an answer; see its output above"
            ) from None
        if status == "error":
            raise RuntimeError(f"the {self.level} process failed:\n{value}")
        return value

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # the process may be gone already
                self._conn.send(("stop", ()))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
        self._conn.close()


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift``: each round starts with the next level."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


@dataclass
class Outcome:
    """What :func:`run_levels` hands back besides the per-level results."""

    results: list[LevelResult]
    rounds: list[dict[str, float]]  # per timed round: level -> seconds per step
    baseline: str
    threads: int
    plan: Plan


def run_levels(
    args: argparse.Namespace, config: RunConfig, *, n_train: int, deadline: float, watch: LoadWatch
) -> Outcome:
    """Time a few steps of every level, size the run, train every level (epochs interleaved),
    then time them (rounds interleaved)."""
    workers = {level: LevelProcess(level, config) for level in args.levels}
    progress: Progress | None = None
    try:
        for worker in workers.values():
            worker.wait_ready()
        threads = {worker.call("threads") for worker in workers.values()}
        results = {level: LevelResult(level, 0.0) for level in workers}
        # Calibration: the same steps on the same batches at every level, so the levels still
        # differ only by their opt level. The first step of each pays one-time set-up.
        for worker in workers.values():
            worker.call("timed_steps", 1)
        step_seconds = {
            level: worker.call("timed_steps", CALIBRATION_STEPS)
            for level, worker in workers.items()
        }
        LOG.info(
            "calibration, seconds per training step: %s",
            ", ".join(f"{level} {sec:.3f}" for level, sec in step_seconds.items()),
        )
        batches = math.ceil(n_train / config.batch_size)
        if args.size is None:
            sized = (
                deadline - time.perf_counter() - RESERVE_SECONDS - 2 * sum(step_seconds.values())
            )
            plan = plan_run(
                step_seconds, seconds=max(sized, 0.0), batches_per_epoch=batches, full=FULL
            )
        else:
            plan = Plan(args.size, step_seconds, batches)
        size = plan.size
        LOG.info(
            "run: %d epochs per level, then %d timed rounds of %d steps per level; about %s%s",
            size.epochs,
            size.rounds,
            size.steps,
            clock(plan.seconds() + RESERVE_SECONDS),
            "" if args.size is not None or size == FULL else " (--full for the full run)",
        )
        progress = Progress(plan.seconds())

        def play(r: int, name: str, steps: int, what: str, *call_args: Any) -> dict[str, Any]:
            """One interleaved round of ``name`` at every level, counted on the progress bar."""
            row = {}
            for level in rotated(list(workers), r):
                row[level] = workers[level].call(name, *call_args)
                assert progress is not None
                progress.advance(steps * step_seconds[level], what)
            return row

        for epoch in range(size.epochs):
            row = play(epoch, "epoch", batches, f"training, epoch {epoch + 1}/{size.epochs}")
            watch.sample()
            for level, (loss, seconds) in row.items():
                results[level].epoch_losses.append(loss)
                results[level].epoch_seconds.append(seconds)
            losses = ", ".join(f"{lv} {row[lv][0]:.4f}" for lv in workers)
            LOG.debug("epoch %d/%d mean loss: %s", epoch + 1, size.epochs, losses)
        for level, worker in workers.items():
            results[level].accuracy = worker.call("accuracy")
        play(0, "timed_steps", size.steps, "timing, warm-up round", size.steps)  # dropped
        rounds = []
        for r in range(size.rounds):
            what = f"timing, round {r + 1}/{size.rounds}"
            rounds.append(play(r, "timed_steps", size.steps, what, size.steps))
            watch.sample()
            times = ", ".join(f"{level} {rounds[-1][level] * 1e3:.1f}" for level in workers)
            LOG.debug("round %d/%d ms per step: %s", r + 1, size.rounds, times)
        progress.finish()
        progress = None
        baseline = "O0" if "O0" in workers else next(iter(workers))
        for level, timing in summarize_rounds(rounds, baseline).items():
            results[level].timing = timing
        for level, worker in workers.items():
            for name, value in worker.call("memory").items():
                setattr(results[level], name, value)
    finally:
        if progress is not None:
            progress.finish()
        for worker in workers.values():
            worker.close()
    return Outcome(list(results.values()), rounds, baseline, threads.pop(), plan)


def accuracy_failures(results: Sequence[LevelResult], n_test: int) -> list[str]:
    """Messages for every checked level that ends too far below O0 (empty when all pass).

    Too far: more than :data:`MAX_DROP_POINTS` below O0 and more than the test set can
    resolve (``accuracy_resolution``: after a short run, with O0 far from 100 %, a few images
    either way are noise, and a tie is no failure).
    """
    baseline = next((r for r in results if r.level == "O0"), None)
    if baseline is None:
        return []
    allowed = max(MAX_DROP_POINTS, accuracy_resolution(baseline.accuracy, n_test))
    return [
        f"{r.level} test accuracy {r.accuracy:.2f}% is {baseline.accuracy - r.accuracy:.2f} "
        f"points below O0 ({baseline.accuracy:.2f}%); allowed: {allowed:.2f} (at least "
        f"{MAX_DROP_POINTS}, and what {n_test} test images resolve)"
        for r in results
        if r.level in CHECKED_LEVELS and baseline.accuracy - r.accuracy > allowed
    ]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    started = time.perf_counter()
    args = parse_args(argv)
    device = pick_device(args.device)
    half_dtype = pick_half_dtype(args.half_dtype, device)
    config = RunConfig(
        seed=args.seed,
        device=device.type,
        half_dtype=str(half_dtype).removeprefix("torch."),
        batch_size=args.batch_size,
        lr=args.lr,
        loss_scale=args.loss_scale,
        threads=args.threads,
        width=args.width,
    )
    # Both optional packages are checked here, before minutes of training, not at their use.
    split = load_split(args.seed, torch.device("cpu"))  # stops with the fix without sklearn
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(
            "the demo draws its figure with matplotlib, which is missing; install it with "
            "`pip install matplotlib`, or run `nox -s demo`"
        )
    watch = LoadWatch()
    watch.sample()
    cores = os.cpu_count() or 1
    threads = args.threads or torch.get_num_threads()
    busy = bool(watch.samples) and watch.samples[-1] >= cores
    if args.threads is None and device.type == "cpu" and busy and threads > 1:
        # Each parallel region of a step waits for a thread the scheduler has parked when
        # other work holds the cores: one thread per level is then several times faster.
        LOG.info(
            "the machine is busy (load average %.1f on %d cores): one thread per level, "
            "which is faster then (--threads sets it)",
            watch.samples[-1],
            cores,
        )
        threads = 1
        config = dataclasses.replace(config, threads=1)
    machine = describe_machine(device, threads, config.half_dtype)
    say_what_to_expect(machine)
    if args.record:  # before minutes of training: the README has a place for this run
        digits_report.record_block(HERE / "README.md", machine.kind)
    if args.out is None:
        args.out = digits_report.record_figure(RECORD_DIR, machine)
    budget = args.budget if args.budget is not None else BUDGET[device.type]
    if args.size is None:
        LOG.info(
            "sizing the run to about %s (--budget %.0f); --full runs the full %d epochs and %d "
            "timed rounds however long they take",
            clock(budget),
            budget,
            FULL.epochs,
            FULL.rounds,
        )
    LOG.info(
        "digits: %d train / %d test images; levels %s on %s (%s), one process each",
        len(split.y_train),
        len(split.y_test),
        " ".join(args.levels),
        device,
        half_dtype,
    )
    outcome = run_levels(
        args, config, n_train=len(split.y_train), deadline=started + budget, watch=watch
    )
    watch.sample()
    results = outcome.results
    machine = dataclasses.replace(machine, threads=outcome.threads)
    timing = next(r.timing for r in results if r.level == outcome.baseline)
    assert timing is not None
    warnings = load_warnings(watch.span(), timing.step_ms.q1, timing.step_ms.q3, cores)
    report = digits_report.Report(
        results=results,
        machine=machine,
        half_dtype=config.half_dtype,
        batch_size=args.batch_size,
        n_params=sum(p.numel() for p in make_model(args.width).parameters()),
        n_test=len(split.y_test),
        epochs=outcome.plan.size.epochs,
        rounds=outcome.rounds,
        steps=outcome.plan.size.steps,
        baseline=outcome.baseline,
        unresolved=unresolved_pairs(outcome.rounds),
        load=watch.span(),
        warnings=warnings,
        sizing=sizing_note(args, budget, outcome.plan),
        seconds=time.perf_counter() - started,
        figure=args.out,
        command=" ".join(sys.argv[1:] if argv is None else argv),
    )
    digits_report.plot(report, args.out)
    print(digits_report.format_table(report))
    digits_report.write_json(report, args.out.with_suffix(".json"))
    if args.record:
        digits_report.record(report, HERE / "README.md")
    for message in warnings:
        LOG.warning("%s", message)
    o0 = next((r for r in results if r.level == "O0"), None)
    if o0 is not None and o0.accuracy < O0_TARGET_ACCURACY:
        LOG.warning(
            "O0 reached %.2f%%, below the %.0f%% target%s",
            o0.accuracy,
            O0_TARGET_ACCURACY,
            f" after {report.epochs} epochs (--full trains {FULL.epochs})"
            if report.epochs < FULL.epochs
            else "",
        )
    LOG.info("done in %s", clock(report.seconds))
    if args.smoke:
        LOG.info("--smoke: %d epochs per level, accuracy not checked", report.epochs)
        return 0
    failures = accuracy_failures(results, len(split.y_test))
    for message in failures:
        LOG.error(message)
    return 1 if failures else 0


def say_what_to_expect(machine: Machine) -> None:
    """Log, before anything runs, what the hardware does with half precision."""
    LOG.info("hardware: %s", machine.describe())
    LOG.info("%s", machine.verdict())
    for line in textwrap.wrap(machine.expectation(), 100):
        LOG.info("  %s", line)


def sizing_note(args: argparse.Namespace, budget: float, plan: Plan) -> str:
    """How the run's size was chosen, for the table."""
    if args.smoke:
        return "--smoke size"
    if args.size is not None:
        return "size from the command line" if not args.full else "--full size"
    return (
        f"sized to a budget of {budget:.0f} s from {CALIBRATION_STEPS} calibration steps per level"
    )


if __name__ == "__main__":
    sys.exit(main())
