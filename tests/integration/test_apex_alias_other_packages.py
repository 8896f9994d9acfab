"""Apex names that ``python -m amp_legacy_fp16.apex_run`` resolves to amp-fused-ops and
amp-optimizers (packages amp-legacy-fp16 does not require): the top-level ``syncbn`` and
``amp_C`` extensions and ``apex.contrib.optimizers``.

``apex_scripts/toolkit_alias_checks.py`` runs the checks under the runner, in one process, and
reports each one; the tests of the hook that need only amp-core and amp-legacy-fp16 are in
that package's test_apex_alias.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "apex_scripts" / "toolkit_alias_checks.py"
TIMEOUT = 600  # a cold start imports torch and may compile the CPU extension on a busy machine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("apex") is not None, reason="a real apex is installed"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = dict(os.environ)
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    run = subprocess.run(
        [sys.executable, "-m", "amp_legacy_fp16.apex_run", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env=env,
        cwd=tmp_path_factory.mktemp("apex_alias"),
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    lines = [line for line in run.stdout.splitlines() if line.startswith("results ")]
    assert len(lines) == 1, f"no results line\n{run.stdout}\n{run.stderr}"
    return dict(json.loads(lines[0].removeprefix("results ")))


@pytest.mark.slow  # one Python process for the three checks
@pytest.mark.parametrize(
    "check",
    [
        "top_level_syncbn_is_the_syncbn_kernels",
        "apex_contrib_optimizers_holds_the_cut_down_fp16_optimizer_and_fused_adam",
        "dir_of_the_top_level_amp_C_lists_its_ops",
    ],
)
def test_apex_name_resolves_to_the_toolkit_package(results: dict[str, str], check: str) -> None:
    assert results.get(check) == "ok", results.get(check, f"{check} did not run: {results}")
