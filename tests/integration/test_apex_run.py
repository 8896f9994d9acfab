"""``python -m amp_legacy_fp16.apex_run``: scripts written for Apex run unchanged.

``apex_scripts/train_with_apex.py`` imports every Apex module the toolkit provides under
Apex's names, checks each of Apex's public names there, probes for Apex as transformers does,
and trains with amp O2, FusedAdam and the fused LayerNorm Function (plus Apex's DDP and
SyncBatchNorm under torchrun). No package named ``apex`` is installed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "apex_scripts" / "train_with_apex.py"
RUNNER = [sys.executable, "-m", "amp_legacy_fp16.apex_run"]
TIMEOUT = 600  # a cold start imports torch and may compile the CPU extension on a busy machine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("apex") is not None, reason="a real apex is installed"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(args: list[str], cwd: Path, expect: int = 0) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT, check=False, env=_env(), cwd=cwd
    )
    assert run.returncode == expect, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run


def _losses(stdout: str) -> list[float]:
    # Not anchored to lines: two ranks' prints may interleave on one line.
    return [float(x) for x in re.findall(r"step \d+ loss (-?\d+\.\d+|nan|inf)", stdout)]


@pytest.mark.slow
def test_an_apex_training_script_runs_unchanged(tmp_path: Path) -> None:
    run = _run([*RUNNER, str(SCRIPT), "--steps", "3"], cwd=tmp_path)
    assert "names 95" in run.stdout
    losses = _losses(run.stdout)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "rank 0 ok" in run.stdout


def test_without_the_runner_there_is_no_apex(tmp_path: Path) -> None:
    run = _run([sys.executable, "-c", "import apex"], cwd=tmp_path, expect=1)
    assert "No module named 'apex'" in run.stderr


def test_the_script_sees_what_python_script_would(tmp_path: Path) -> None:
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    (script.parent / "helper_mod.py").write_text("VALUE = 7\n")
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import helper_mod  # found next to the script, as with `python probe.py`
            from apex import amp
            print("argv", sys.argv)
            print("name", __name__, helper_mod.VALUE)
            sys.exit(3)
            """
        )
    )
    run = _run([*RUNNER, str(script), "--flag", "x"], cwd=tmp_path, expect=3)
    assert f"argv {[str(script), '--flag', 'x']}" in run.stdout
    assert "name __main__ 7" in run.stdout


def test_the_runner_runs_a_module_with_dash_m(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import sys\nimport amp_C\nfrom apex.optimizers import FusedAdam\n"
        "print('module', __name__, sys.argv[1:], FusedAdam.__module__.split('.')[0])\n"
    )
    run = _run([*RUNNER, "-m", "mypkg.train", "--lr", "1"], cwd=tmp_path)
    assert "module __main__ ['--lr', '1'] amp_optimizers\n" in run.stdout


def test_usage_errors(tmp_path: Path) -> None:
    run = _run(RUNNER, cwd=tmp_path, expect=2)
    assert "usage: python -m amp_legacy_fp16.apex_run SCRIPT.py" in run.stderr
    run = _run([*RUNNER, "missing.py"], cwd=tmp_path, expect=2)
    assert "can't open file 'missing.py'" in run.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_the_runner_under_torchrun_with_two_gloo_ranks(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = [*torchrun, "--nproc-per-node", "2", "-m", "amp_legacy_fp16.apex_run"]
    run = _run([*args, str(SCRIPT), "--steps", "3"], cwd=tmp_path)
    assert run.stdout.count("names 95") == 2
    assert "rank 0 ok" in run.stdout and "rank 1 ok" in run.stdout
    assert len(_losses(run.stdout)) == 6


@pytest.mark.slow
def test_children_of_every_start_method_get_the_apex_names(tmp_path: Path) -> None:
    # fairseq's single-node launcher uses torch.multiprocessing.spawn; DataLoader workers and
    # user code may use spawn or forkserver: each child is a new interpreter.
    script = ROOT / "tests" / "integration" / "apex_scripts" / "spawn_children.py"
    run = _run([*RUNNER, str(script)], cwd=tmp_path)
    lines = [line for line in run.stdout.splitlines() if ": " in line]
    methods = [line.split(": ", 1)[0] for line in lines]
    assert methods == ["spawn", "forkserver", "fork", *["torch.multiprocessing.spawn"] * 2]
    for line in lines:
        assert "amp_optimizers" in line and "ops=16 scalers=[]" in line, line


def test_the_runner_exports_the_aliases_to_new_interpreters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from amp_legacy_fp16 import apex_run

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("AMP_APEX_RUN", raising=False)
    apex_run.export_to_children()
    apex_run.export_to_children()  # once only
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [apex_run.BOOT_DIR, "/somewhere"]
    assert os.environ["AMP_APEX_RUN"] == "1"
    assert os.path.isfile(os.path.join(apex_run.BOOT_DIR, "sitecustomize.py"))
