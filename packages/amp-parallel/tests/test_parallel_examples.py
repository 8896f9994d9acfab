"""The torchrun examples run unchanged and verify their own results (exit code 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _parallel_launch import free_port

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "distributed"


def _torchrun(script: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    src = [str(ROOT / "packages" / p / "src") for p in ("amp-core", "amp-parallel")]
    env["PYTHONPATH"] = os.pathsep.join([*src, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(EXAMPLES / script),
        "--smoke",
    ]
    # The timeout only catches a hang; it is generous so that a loaded machine cannot fail it.
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("script", ["ddp_amp_o2.py", "syncbn.py"])
def test_example_runs_on_cpu(script):
    proc = _torchrun(script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("script", ["ddp_amp_o2.py", "syncbn.py"])
def test_example_runs_on_gpus_with_nccl(script):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for NCCL")
    proc = _torchrun(script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
def test_syncbn_on_cuda_matches_batchnorm():
    from amp_parallel import SyncBatchNorm

    ref = torch.nn.BatchNorm2d(4).cuda()
    bn = SyncBatchNorm(4).cuda()
    x = torch.randn(6, 4, 5, 5, device="cuda", requires_grad=True)
    gy = torch.randn(6, 4, 5, 5, device="cuda")
    (gx_ref,) = torch.autograd.grad((ref(x) * gy).sum(), [x])
    out = bn(x.half())
    (gx,) = torch.autograd.grad((out.float() * gy).sum(), [x])
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref(x), rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-3, atol=2e-3)
