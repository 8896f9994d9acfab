"""examples/bf16_stochastic_rounding in --smoke size: the three runs, their figures and the plot.

Runs the script as a user would (a subprocess, on CPU) and checks what it must show even in a
short run: pure bfloat16 with round-to-nearest ends measurably behind float32, and stochastic
rounding ends close to float32, with less memory for the weights.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "bf16_stochastic_rounding" / "train_pure_bf16.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_smoke_run_shows_stochastic_rounding_keeping_up_with_fp32(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    png = tmp_path / "curves.png"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=600,  # catches a hang, not slowness
        check=False,
        env=_env(),
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {
        m.group(1): (float(m.group(2)), float(m.group(3)), int(m.group(4)))
        for m in re.finditer(
            r"^(fp32|bf16-nearest|bf16-stochastic)\s+([\d.]+)\s+\S+\s+([\d.]+)\s+\S+\s+(\d+)KB",
            run.stdout,
            flags=re.MULTILINE,
        )
    }
    assert set(rows) == {"fp32", "bf16-nearest", "bf16-stochastic"}, run.stdout
    fp32_loss, fp32_acc, fp32_weights = rows["fp32"]
    rn_loss, _, rn_weights = rows["bf16-nearest"]
    sr_loss, sr_acc, sr_weights = rows["bf16-stochastic"]
    assert rn_loss > 1.1 * fp32_loss, run.stdout  # round-to-nearest falls behind
    assert abs(sr_loss - fp32_loss) < 0.03 * fp32_loss, run.stdout
    assert sr_acc > fp32_acc - 3.0, run.stdout
    assert sr_weights == rn_weights and 2 * sr_weights == fp32_weights, run.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000
