"""Constants and small builders shared by the amp_core tests (not a test module)."""

from __future__ import annotations

import copy

import pytest
import torch

HALF_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]

# Same test bodies on both devices; the cuda variant is skipped without CUDA
# (the root conftest also skips `gpu` tests, this keeps the package self-contained).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]

# Tolerances for one low-precision op against its float32 reference (STYLE habit 8).
OP_TOL = {
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}

# Tolerances for results that chain a few low-precision ops (forward + backward +
# one optimizer step of a 2-layer net): each matmul rounds its output once, so the
# error is a small multiple of one op's bound.
CHAIN_TOL = {
    torch.float16: dict(rtol=1e-2, atol=5e-3),
    torch.bfloat16: dict(rtol=6e-2, atol=4e-2),
}


def tiny_mlp(seed: int = 0, din: int = 4, dhid: int = 8, dout: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(din, dhid), torch.nn.ReLU(), torch.nn.Linear(dhid, dout)
    )


def tiny_bn_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def batch(seed: int, n: int = 8, din: int = 4, dout: int = 3, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, din, generator=g) * 0.5
    y = torch.randn(n, dout, generator=g) * 0.5
    return x.to(device), y.to(device)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent float32 twin (deep copy taken before amp.initialize)."""
    return copy.deepcopy(model).float()


def params_as_float(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def amp_log_records(caplog: pytest.LogCaptureFixture) -> list:
    return [r for r in caplog.records if r.name.startswith("amp_core")]
