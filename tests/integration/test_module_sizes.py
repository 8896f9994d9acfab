"""No Python source of the packages is over 450 lines.

A module that long has usually taken on a second job; splitting it by job keeps each one
readable on its own (docs/architecture.rst maps the modules to their jobs). A text scan: no
imports.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450


def test_no_source_module_is_over_the_limit() -> None:
    sources = sorted((ROOT / "packages").glob("*/src/**/*.py"))
    assert sources, "no package sources found"
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in sources
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"over {MAX_LINES} lines (split by job): {too_long}"
