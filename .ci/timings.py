"""Time nox sessions and write the timing table of README.md from the recorded figures.

Usage::

    python .ci/timings.py --run build docs lint wheel_prebuilt   # time these sessions now
    python .ci/timings.py --from-ci-log ci.log                   # take the times .ci/run printed
    python .ci/timings.py                                        # only rewrite the table

Every figure lives in ``.ci/timings.json`` with the machine it was measured on, the load
average during the run and the date; the table between the ``<!-- timings:start -->`` and
``<!-- timings:end -->`` markers of README.md is generated from that file and nothing else, so
a figure cannot be edited in the README without the file (and the run it came from). ``--run``
runs ``python -m nox -s <session>`` once per session, one after the other, sampling the load
average every second. ``--from-ci-log`` reads the lines ``.ci/run: 'nox -s build' took 67 s``
of a saved CI log, with the load average at the start and the end of the step, and the machine
from the ``CPU:`` line .ci/run prints first (cores, model, whether bfloat16 is native there:
CI's time depends on it, see .ci/cpu_features.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cpu_features  # .ci/, this script's folder

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".ci" / "timings.json"
README = ROOT / "README.md"
START, END = "<!-- timings:start -->", "<!-- timings:end -->"
CI_LINE = re.compile(
    r"^\.ci/run: '(?P<command>[^']+)' took (?P<s>\d+) s"
    r"(?: \(load average (?P<load>[\d.]+ to [\d.]+)\))?"
)


def machine(cpu: str | None = None) -> str:
    """One line: cores, CPU model and whether its bfloat16 is native, OS, Python.

    ``cpu`` replaces the cores and the model: the ``CPU:`` line ``.ci/run`` printed.
    """
    if cpu is None:
        model, flags = cpu_features.cpuinfo()
        cpu = f"{os.cpu_count()} cores of {model} ({cpu_features.kind(flags)})"
    python = ".".join(map(str, sys.version_info[:2]))
    return f"{cpu}, {platform.system()}, Python {python}, no GPU"


class LoadSampler:
    """Samples the 1-minute load average every second while a command runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(1.0)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def describe(self) -> str:
        if not self.samples:
            return "unknown"
        return f"{min(self.samples):.1f} to {max(self.samples):.1f}"


def load_data() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def save_data(data: dict[str, Any]) -> None:
    DATA.write_text(json.dumps(data, indent=2) + "\n")


def row(data: dict[str, Any], command: str) -> dict[str, Any] | None:
    for entry in data["rows"]:
        if entry["command"] == command:
            return entry
    return None


def run_sessions(data: dict[str, Any], sessions: list[str]) -> int:
    for session in sessions:
        command = f"nox -s {session}"
        entry = row(data, command)
        if entry is None:
            raise SystemExit(f"{DATA} has no row for {command!r}; add one (with its 'what')")
        print(f"timings: running {command}", flush=True)
        start = time.perf_counter()
        with LoadSampler() as load:
            result = subprocess.run([sys.executable, "-m", "nox", "-s", session], cwd=ROOT)
        seconds = round(time.perf_counter() - start)
        if result.returncode != 0:
            print(f"timings: {command} failed (exit {result.returncode}); not recorded")
            return result.returncode
        entry.update(
            seconds=seconds,
            time=None,
            source="measured by .ci/timings.py --run",
            machine=machine(),
            load=load.describe(),
            date=datetime.date.today().isoformat(),
        )
        print(f"timings: {command} took {seconds} s (load average {load.describe()})")
        save_data(data)
    return 0


def read_ci_log(data: dict[str, Any], log: Path) -> None:
    lines = log.read_text().splitlines()
    # The machine that ran CI, as .ci/run printed it first (.ci/cpu_features.py).
    cpus = [line.removeprefix("CPU: ") for line in lines if line.startswith("CPU: ")]
    for line in lines:
        match = CI_LINE.match(line)
        if match is None:
            continue
        entry = row(data, match["command"].strip())
        if entry is None:
            print(f"timings: {DATA.name} has no row for {match['command']!r}; skipped")
            continue
        entry.update(
            seconds=int(match["s"]),
            time=None,
            source=f"printed by .ci/run ({log.name})",
            machine=machine(cpus[0] if cpus else None),
            load=match["load"] or "not printed",
            date=datetime.date.fromtimestamp(log.stat().st_mtime).isoformat(),
        )
    save_data(data)


def render(data: dict[str, Any]) -> str:
    lines = [
        "| command | wall time | measured | what takes the time |",
        "|---|---|---|---|",
    ]
    for entry in data["rows"]:
        if not entry.get("time") and entry.get("seconds") is None:
            continue  # a row no run has filled yet
        wall = entry.get("time") or f"{entry['seconds']} s"
        measured = f"{entry['date']}, load {entry['load']}; {entry['source']}"
        command = entry.get("label") or f"`{entry['command']}`"
        lines.append(f"| {command} | {wall} | {measured} | {entry['what']} |")
    sources: dict[str, set[str]] = {}
    for entry in data["rows"]:
        if entry.get("time") or entry.get("seconds") is not None:
            sources.setdefault(entry["machine"], set()).add(entry["source"])
    lines.append("")
    for name, how in sorted(sources.items()):
        lines.append(f"- {', '.join(sorted(how))}: {name}.")
    return "\n".join(lines)


def write_readme(data: dict[str, Any]) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    note = "<!-- generated by .ci/timings.py from .ci/timings.json: edit those, not this -->"
    README.write_text(f"{head}{START}\n{note}\n{render(data)}\n{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs="*", default=[], metavar="SESSION")
    parser.add_argument("--from-ci-log", type=Path)
    args = parser.parse_args()
    data = load_data()
    status = 0
    if args.from_ci_log is not None:
        read_ci_log(data, args.from_ci_log)
    if args.run:
        status = run_sessions(data, args.run)
    write_readme(data)
    print(f"timings: README.md table written from {DATA.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
