"""How long the digits demo runs: a run sized to a time budget, its progress bar, the load.

The demo first times a few training steps of every level, then picks the number of epochs
and of timed rounds that fit the budget (never more than the full run). A CPU without native
bfloat16 takes ten times longer per step than one with it, so a fixed size is either too long
there or too short elsewhere; the measured size fits both.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

LOG = logging.getLogger("train_digits")

# Share of the sized part of the budget spent on the timed rounds; the rest trains.
TIMING_SHARE = 0.4
# Fewer timed rounds than this leave the interquartile range meaningless.
MIN_ROUNDS = 5
MIN_STEPS = 2
# A change of the 1-minute load average by this much during the run gets a warning: one core
# more or less busy changes every step time.
LOAD_CHANGE_WARNING = 1.0
# O0's step time moving by more than this (third quartile over first) across the rounds.
STEP_DRIFT_WARNING = 1.25


@dataclass(frozen=True)
class Size:
    """How much a run does per level."""

    epochs: int
    rounds: int  # timed rounds, after one untimed warm-up round
    steps: int  # training steps per level in each timed round

    def __post_init__(self) -> None:
        for name in ("epochs", "rounds", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Size.{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Plan:
    """A run's size and what it is expected to cost, from the measured step times."""

    size: Size
    step_seconds: dict[str, float]  # per level, from the calibration steps
    batches_per_epoch: int

    @property
    def all_levels_step(self) -> float:
        """Seconds for one training step of every level (they take turns)."""
        return sum(self.step_seconds.values())

    def training_seconds(self) -> float:
        return self.size.epochs * self.batches_per_epoch * self.all_levels_step

    def timing_seconds(self) -> float:
        return (self.size.rounds + 1) * self.size.steps * self.all_levels_step

    def seconds(self) -> float:
        return self.training_seconds() + self.timing_seconds()


def plan_run(
    step_seconds: Mapping[str, float], *, seconds: float, batches_per_epoch: int, full: Size
) -> Plan:
    """The largest run up to ``full`` whose training and timed rounds fit in ``seconds``.

    The timed rounds get :data:`TIMING_SHARE` of the time, at least :data:`MIN_ROUNDS` rounds
    of :data:`MIN_STEPS` steps; training gets the rest, at least one epoch. A machine too slow
    even for that gets that minimum, and a warning says how long it will take.
    """
    per_step = sum(step_seconds.values())  # one step at every level
    if per_step <= 0.0:
        raise ValueError(f"the calibration measured no time per step: {dict(step_seconds)}")
    timed_steps = TIMING_SHARE * seconds / per_step  # per level, warm-up round included
    steps = max(MIN_STEPS, min(full.steps, int(timed_steps / (full.rounds + 1))))
    rounds = max(MIN_ROUNDS, min(full.rounds, int(timed_steps / steps) - 1))
    timing = (rounds + 1) * steps * per_step
    epochs = int((seconds - timing) / (batches_per_epoch * per_step))
    size = Size(max(1, min(full.epochs, epochs)), rounds, steps)
    plan = Plan(size, dict(step_seconds), batches_per_epoch)
    if plan.seconds() > seconds * 1.1:
        LOG.warning(
            "this machine is slow for the demo (a load average far above its cores does "
            "that): even the smallest run (%d epoch, %d rounds of %d steps) takes about %.0f s, "
            "more than the %.0f s left of the time budget",
            plan.size.epochs,
            rounds,
            steps,
            plan.seconds(),
            seconds,
        )
    return plan


def clock(seconds: float) -> str:
    """``seconds`` as ``m:ss``."""
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


@dataclass
class Progress:
    """A progress bar with an estimate of the time left, on stderr.

    Work is counted in predicted seconds (the calibration's step times); the estimate scales
    what is left by how fast the run has gone so far. On a terminal the bar is redrawn in
    place; otherwise (a log file, CI) a line is logged every tenth of the way.
    """

    total: float  # predicted seconds of all the work
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    width: int = 30
    done: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    _logged_tenths: int = -1

    def advance(self, predicted: float, what: str) -> None:
        self.done = min(self.total, self.done + predicted)
        self._show(what)

    def left(self) -> float:
        """Estimated seconds left: the predicted rest, at the pace observed so far."""
        elapsed = time.perf_counter() - self.started
        if self.done <= 0.0:
            return self.total - elapsed
        return (self.total - self.done) * elapsed / self.done

    def line(self, what: str) -> str:
        fraction = self.done / self.total if self.total > 0 else 1.0
        filled = int(self.width * fraction)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.started
        return (
            f"[{bar}] {fraction:4.0%} {what}; {clock(elapsed)} so far, "
            f"about {clock(self.left())} left"
        )

    def _show(self, what: str) -> None:
        if self.stream.isatty():
            self.stream.write("\r" + self.line(what).ljust(100))
            self.stream.flush()
            return
        tenths = int(10 * self.done / self.total) if self.total > 0 else 10
        if tenths > self._logged_tenths:
            self._logged_tenths = tenths
            LOG.info("%s", self.line(what))

    def finish(self) -> None:
        if self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


def load_average() -> float | None:
    """The 1-minute load average, where the platform has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass
class LoadWatch:
    """The machine's load average, sampled through the run."""

    samples: list[float] = field(default_factory=list)

    def sample(self) -> None:
        load = load_average()
        if load is not None:
            self.samples.append(load)

    def span(self) -> tuple[float, float] | None:
        return (min(self.samples), max(self.samples)) if self.samples else None


def load_warnings(
    loads: tuple[float, float] | None, o0_step_q1: float, o0_step_q3: float, cores: int
) -> list[str]:
    """Warnings that the machine changed under the run, from the load and from O0's times.

    Args:
        loads: the lowest and highest 1-minute load average sampled during the run.
        o0_step_q1, o0_step_q3: quartiles of the baseline's step time over the timed rounds.
        cores: the machine's CPU count (a load above it means threads wait for a core).
    """
    warnings = []
    if loads is not None:
        low, high = loads
        if high - low >= LOAD_CHANGE_WARNING:
            warnings.append(
                f"the machine's load changed during the run (1-minute load average {low:.1f} "
                f"to {high:.1f}): step times moved with it; the ratios divide times of the same "
                "round, which protects them, but their spread is wider and a rerun on a quiet "
                "machine may differ"
            )
        if high > cores:
            warnings.append(
                f"the load average reached {high:.1f} on {cores} cores: other work competed for "
                "the CPU, so the absolute step times are longer than on an idle machine"
            )
    if o0_step_q1 > 0 and o0_step_q3 / o0_step_q1 > STEP_DRIFT_WARNING:
        warnings.append(
            f"O0's own step time varied by {o0_step_q3 / o0_step_q1 - 1:.0%} between rounds "
            "(interquartile range): treat the ratios' error bars as the real uncertainty"
        )
    return warnings


def accuracy_resolution(accuracy: float, n_test: int) -> float:
    """Smallest accuracy difference (percentage points) that this test set can resolve.

    The standard error of an accuracy measured on ``n_test`` images (binomial), and never
    less than one image: two levels closer than this are tied.
    """
    if n_test < 1:
        raise ValueError(f"accuracy_resolution needs at least one test image, got {n_test}")
    p = min(max(accuracy / 100.0, 0.0), 1.0)
    return 100.0 * max(1.0 / n_test, math.sqrt(p * (1.0 - p) / n_test))
