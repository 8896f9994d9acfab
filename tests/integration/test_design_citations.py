"""Citations of design decisions point at docs/design.rst, and at decisions it has.

Code comments cite "docs/design.rst, decision N"; a citation of a document that is not in the
repository, or of a decision number the page does not have, sends the reader nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.rst"
SCANNED = ["packages", "benchmarks", "tests", "examples", "docs", ".ci"]
SUFFIXES = {".py", ".md", ".rst", ".cpp", ".cu", ".h", ".cuh", ".toml"}
# A citation of a document outside the repository (the old form of these references).
_OUTSIDE = re.compile(r"DESIGN(?:\.md| decision)|\bGPU\.md\b")
_CITATION = re.compile(r"docs/design\.rst,?\s+decisions?\s+(\d+)")


def _text_files() -> list[Path]:
    files = [ROOT / "noxfile.py", ROOT / "README.md"]
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*"):
            if "_build" in path.parts or path == Path(__file__).resolve():
                continue
            if path.is_file() and path.suffix in SUFFIXES:
                files.append(path)
    return files


def _decision_numbers() -> set[int]:
    """The numbers of the decisions docs/design.rst lists (``N. **Title**`` items)."""
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", DESIGN.read_text(), re.MULTILINE)}


def test_design_page_numbers_its_decisions_one_to_twelve() -> None:
    assert _decision_numbers() == set(range(1, 13))


def test_no_citation_of_a_document_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert not found, "cite docs/design.rst (e.g. 'docs/design.rst, decision 5'):\n" + "\n".join(
        found
    )


def test_every_cited_decision_exists() -> None:
    numbers = _decision_numbers()
    cited = [
        (path, int(match.group(1)))
        for path in _text_files()
        for match in _CITATION.finditer(path.read_text(errors="replace"))
    ]
    assert cited, "expected code to cite docs/design.rst by decision number"
    missing = [f"{path.relative_to(ROOT)}: decision {n}" for path, n in cited if n not in numbers]
    assert not missing, f"citations of decisions docs/design.rst does not have: {missing}"
