"""pytest collects every test of the repository in one run from its root, without error.

pytest's default import mode puts each tests folder on ``sys.path`` and imports test files and
their helper modules by basename, so two files with one basename in different tests folders
clash (the second fails to import, or silently gets the first). These checks keep the names
unique and run the real collection once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_DIRS = [*sorted((ROOT / "packages").glob("*/tests")), ROOT / "tests"]


def _modules_by_basename() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for folder in TEST_DIRS:
        for path in folder.rglob("*.py"):
            if path.name in ("conftest.py", "__init__.py") or "apex_scripts" in path.parts:
                continue
            found[path.name].append(str(path.relative_to(ROOT)))
    return found


def test_test_and_helper_module_basenames_are_unique() -> None:
    clashes = {name: paths for name, paths in _modules_by_basename().items() if len(paths) > 1}
    assert not clashes, (
        f"modules with the same basename in several tests folders: {clashes}; rename them "
        "(e.g. prefix the package's name) so that pytest can import each one"
    )


def test_no_test_imports_from_conftest() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for folder in TEST_DIRS
        for path in folder.rglob("*.py")
        if path != Path(__file__).resolve()
        and any(
            line.strip().startswith(("from conftest import", "import conftest"))
            for line in path.read_text().splitlines()
        )
    ]
    assert not offenders, (
        f"{offenders} import a conftest module by name, which resolves to whichever "
        "package's conftest.py pytest loaded last; move the helper into a uniquely named "
        "helper module of that tests folder"
    )


def test_pytest_collects_the_whole_repository_from_its_root() -> None:
    sources = sorted(str(path) for path in (ROOT / "packages").glob("*/src"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sources), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = "\n".join(run.stdout.splitlines()[-30:])
    assert run.returncode == 0, f"pytest --collect-only failed ({run.returncode}):\n{tail}"
    assert " error" not in run.stdout.splitlines()[-1], tail
