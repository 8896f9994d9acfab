"""Every module of every package imports first, in any order, in a fresh interpreter.

A runtime import cycle shows as an ImportError ("partially initialized module") when the
module in the middle of the cycle happens to be imported first; shuffling the order over a few
seeds finds it without knowing where it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src"))
# Run as programs or by the interpreter at start-up, not imported by the toolkit.
SKIPPED_NAMES = ("__main__", "sitecustomize")


def _modules() -> list[str]:
    names = []
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts and parts[-1] not in SKIPPED_NAMES:
                names.append(".".join(parts))
    return names


_CHECK = """
import importlib, random, sys
names = sys.argv[2:]
random.Random(int(sys.argv[1])).shuffle(names)
first = names[0]
importlib.import_module(first)  # alone first: a cycle through it breaks here
for name in names[1:]:
    importlib.import_module(name)
print(first)
"""


def test_the_module_list_covers_every_package() -> None:
    tops = {name.split(".")[0] for name in _modules()}
    assert tops == {"amp_core", "amp_fused_ops", "amp_optimizers", "amp_parallel",
                    "amp_legacy_fp16"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_modules_import_in_a_random_order(seed: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCES))}
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(seed), *_modules()],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


_EACH_FIRST = """
import importlib, os, sys, torch  # torch once: each child below starts from this state
failures = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException as error:
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failures.append(name)
sys.exit(1 if failures else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (one child per module)")
def test_each_module_imports_first() -> None:
    """Each module first in its own child of an interpreter that has imported only torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCES))}
    done = subprocess.run(
        [sys.executable, "-c", _EACH_FIRST, *_modules()],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
