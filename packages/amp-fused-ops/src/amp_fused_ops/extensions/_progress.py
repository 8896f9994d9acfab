"""How long a build should take, and progress lines while it runs.

The estimate comes from the work (the number of translation units), the cores this process
may use, ``MAX_JOBS``, the load average (other work sharing the cores) and the time one unit
took in the last build of the same kind on this machine (recorded in its build record), or a
default cost per unit until one was measured. While torch's ninja build runs, a thread reads
ninja's log (``.ninja_log``, one line per finished step) and logs ``[n/m]`` as steps finish,
and a line with the elapsed time when nothing finished for a while.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from types import TracebackType

from . import _cache as cache
from . import _lock as lock
from ._settings import MARKER

logger = logging.getLogger(__name__)

SECONDS_PER_UNIT = {"cpu": 20.0, "cuda": 100.0}
"""Default seconds per translation unit on one idle core (torch's headers dominate): gcc 12
with torch 2.13, nvcc 13.0 with torch 2.14 for one architecture."""
HEARTBEAT_SECONDS = 30.0
"""A line with the elapsed time after this long without a finished step."""
POLL_SECONDS = 1.0


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def parallel_jobs(units: int, cores: int) -> int:
    """How many units compile at once: ``MAX_JOBS`` (else ninja's default), at most the cores."""
    try:
        jobs = int(os.environ.get("MAX_JOBS", "") or cores + 2)
    except ValueError:
        jobs = cores + 2
    return max(1, min(jobs, cores, units))


def load_factor(cores: int) -> float:
    """How many processes compete for each core (1.0 on an idle machine)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, load / cores)


def measured_seconds_per_unit(kind: str) -> float | None:
    """Seconds per unit on one idle core in the latest recorded build of ``kind`` here."""
    latest: tuple[float, float] | None = None
    try:
        markers = list(cache.cache_root().glob(f"{kind}-*/{MARKER}"))
    except OSError:
        return None
    for marker in markers:
        try:
            record = json.loads(marker.read_text())
            rounds = math.ceil(int(record["units"]) / int(record["jobs"]))
            per_unit = float(record["seconds"]) / rounds / float(record.get("load", 1.0))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
        when = marker.stat().st_mtime
        if per_unit > 0 and (latest is None or when > latest[0]):
            latest = (when, per_unit)
    return latest[1] if latest is not None else None


def estimate_seconds(kind: str, units: int) -> float:
    """Expected wall time of a build of ``kind`` with ``units`` translation units here."""
    cores = usable_cores()
    per_unit = measured_seconds_per_unit(kind) or SECONDS_PER_UNIT[kind]
    rounds = math.ceil(max(1, units) / parallel_jobs(units, cores))
    return per_unit * rounds * load_factor(cores)


def describe_estimate(kind: str, units: int) -> str:
    """``"about 80 s: 5 units, 2 at a time on 2 cores, load 1.3"``."""
    cores = usable_cores()
    return (
        f"about {estimate_seconds(kind, units):.0f} s: {units} units, "
        f"{parallel_jobs(units, cores)} at a time on {cores} cores, "
        f"load {load_factor(cores) * cores:.1f}"
    )


def finished_steps(build_dir: Path) -> list[str]:
    """The outputs ninja has finished in ``build_dir``, in order (from ``.ninja_log``)."""
    try:
        lines = (build_dir / ".ninja_log").read_text().splitlines()
    except OSError:
        return []
    outputs: list[str] = []
    for line in lines:
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 5 or fields[3] in outputs:
            continue
        outputs.append(fields[3])
    return outputs


class BuildProgress:
    """Logs a build's progress from a thread while the ``with`` block runs.

    Args:
        kind: The extension kind being built.
        build_dir: Its build folder (where ninja writes ``.ninja_log``).
        steps: The number of ninja steps (units plus the link).
        estimate: The expected seconds, repeated in the heartbeat lines.
    """

    def __init__(self, kind: str, build_dir: Path, steps: int, estimate: float) -> None:
        self.kind = kind
        self.build_dir = build_dir
        self.steps = steps
        self.estimate = estimate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="amp_fused_ops-build", daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> BuildProgress:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        reported = 0
        last_line = 0.0
        lock.update_progress(self.build_dir, f"[0/{self.steps}] steps done")
        while not self._stop.wait(POLL_SECONDS):
            elapsed = time.monotonic() - self._start
            done = finished_steps(self.build_dir)
            for step in done[reported:]:
                reported += 1
                logger.warning(
                    "[%d/%d] %s extension: built %s (%.0f s)",
                    reported,
                    self.steps,
                    self.kind.upper(),
                    step,
                    elapsed,
                )
                last_line = elapsed
                lock.update_progress(self.build_dir, f"[{reported}/{self.steps}] steps done")
            if elapsed - last_line >= HEARTBEAT_SECONDS:
                logger.warning(
                    "still compiling the %s extension: %.0f s so far (estimate %.0f s), "
                    "%d of %d steps done",
                    self.kind.upper(),
                    elapsed,
                    self.estimate,
                    reported,
                    self.steps,
                )
                last_line = elapsed
