"""The GPU status is stated the same way in every README and docs page.

README.md's "GPU status" section is the source: the GPU, the torch build and the date of the
last GPU run. Every other statement of the status names the same run, and no page says that
the code has never run on a GPU; what has not run on a GPU since is said with what changed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The pages users read; changelogs are history and keep what was true when written.
PAGES = sorted(
    {
        README,
        *ROOT.glob("packages/*/README.md"),
        *ROOT.glob("docs/*.rst"),
        *ROOT.glob("examples/**/README.md"),
        *ROOT.glob("examples/README.md"),
        *ROOT.glob("benchmarks/*.md"),
    }
)
# A sentence saying something has not run on a GPU must say what is new since the GPU run
# (or that it needs two GPUs, which no run has had).
NOT_RUN = re.compile(r"not (yet )?(been )?run on (a )?GPUs?|not yet run on a GPU", re.I)
SINCE = re.compile(r"\bsince\b|after that run|\bchanged\b|two[- ]GPU", re.I)
LAST_RUN = re.compile(
    r"Run on one GPU \((?P<gpu>NVIDIA \w+), torch (?P<torch>\S+), CUDA [\d.]+\) on "
    r"(?P<date>\d{4}-\d\d-\d\d)"
)


def _last_run() -> dict[str, str]:
    match = LAST_RUN.search(README.read_text())
    assert match, "README.md's GPU status no longer says which GPU, torch and date"
    return match.groupdict()


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return re.split(r"(?<=[.;])\s+(?=[A-Z*`(])", flat)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_gpu_status_statement_names_the_last_gpu_run(page: Path) -> None:
    run = _last_run()
    text = page.read_text()
    for match in re.finditer(r"GPU status:", text):
        # The statement: from "GPU status:" to the end of its paragraph.
        statement = re.split(r"\n\s*\n", text[match.start() :], maxsplit=1)[0]
        statement = re.sub(r"\s+", " ", statement)
        for fact in run.values():
            assert fact in statement, f"{_rel(page)}: {statement!r} does not name {fact}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_nothing_claims_the_code_never_ran_on_a_gpu(page: Path) -> None:
    stale = [s for s in _sentences(page.read_text()) if NOT_RUN.search(s) and not SINCE.search(s)]
    assert not stale, f"{_rel(page)} says, without saying what changed since the GPU run: {stale}"


def test_the_pages_are_found() -> None:
    names = {_rel(p) for p in PAGES}
    assert {"README.md", "docs/index.rst", "packages/amp-parallel/README.md"} <= names
    assert _last_run()["gpu"] == "NVIDIA H200"
