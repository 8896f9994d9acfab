"""List the slowest tests of the last test run, so that a new slow test is seen when it lands.

Usage::

    AMP_TEST_REPORTS=.nox/test-reports AMP_SLOW_TESTS=1 nox -s tests
    python3 .ci/slowest_tests.py .nox/test-reports            # the 20 slowest, all sessions
    python3 .ci/slowest_tests.py .nox/test-reports --top 40

``nox -s tests`` (and ``slow_tests``) write one JUnit XML report per session into the folder
``AMP_TEST_REPORTS`` names; ``.ci/run`` sets it and calls this script after the tests step.
A test's time is what ``pytest --durations`` reports for its setup, call and teardown
together (a module-scoped fixture counts in the first test that uses it). The list is a
budget check, not a test: it fails nothing, since a time depends on the machine (bfloat16
training is several times slower without AMX or AVX512-BF16, see .ci/cpu_features.py) and on
its load. README.md, "Test tiers", says what belongs in the ``slow`` tier and how small a
test of the examples should be. Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One test of one report: its session (the report's name), id and seconds."""

    session: str
    test: str
    seconds: float


def read_reports(folder: Path) -> list[Case]:
    """Every test case of every ``*.xml`` JUnit report in ``folder``."""
    cases = []
    for report in sorted(folder.glob("*.xml")):
        for case in ET.parse(report).getroot().iter("testcase"):
            path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            cases.append(
                Case(report.stem, f"{path}::{case.get('name', '?')}", float(case.get("time", 0)))
            )
    return cases


def table(cases: list[Case], top: int) -> str:
    """The ``top`` slowest cases, slowest first, then each session's total."""
    slowest = sorted(cases, key=lambda case: case.seconds, reverse=True)[:top]
    lines = [f"the {len(slowest)} slowest of {len(cases)} tests (setup + call + teardown):"]
    lines += [f"{case.seconds:8.1f} s  {case.session}: {case.test}" for case in slowest]
    totals: dict[str, float] = {}
    for case in cases:
        totals[case.session] = totals.get(case.session, 0.0) + case.seconds
    lines.append("in all: " + ", ".join(f"{name} {s:.0f} s" for name, s in sorted(totals.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("folder", type=Path, help="the folder AMP_TEST_REPORTS named")
    parser.add_argument("--top", type=int, default=20, help="how many tests to list")
    args = parser.parse_args(argv)
    cases = read_reports(args.folder)
    if not cases:
        print(f"no JUnit reports (*.xml) with tests in {args.folder}", file=sys.stderr)
        return 1
    print(table(cases, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
