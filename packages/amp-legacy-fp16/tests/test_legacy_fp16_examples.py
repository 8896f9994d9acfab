"""The scripts under examples/fp16_optimizer run and succeed (each checks its own result)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import amp_core
import amp_legacy_fp16

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fp16_optimizer"
# Catches a hang, not slowness: generous so that a loaded machine cannot fail a test.
HANG_TIMEOUT_S = 900


def _env() -> dict[str, str]:
    # The examples import both packages: make them importable however the tests found them.
    paths = [str(Path(m.__file__).resolve().parents[1]) for m in (amp_core, amp_legacy_fp16)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minimal", "closure", "save_load"])
def test_example_runs(name):
    result = _run([str(EXAMPLES / f"{name}.py"), "--smoke"], timeout=HANG_TIMEOUT_S)
    assert "loss" in result.stderr or "bitwise: True" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_example_runs_on_two_processes():
    result = _run(
        [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={_free_port()}",
            str(EXAMPLES / "distributed.py"),
            "--steps",
            "5",
        ],
        timeout=HANG_TIMEOUT_S,
    )
    assert "ranks in sync: True" in result.stdout + result.stderr
