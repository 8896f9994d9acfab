"""The CUDA norm kernels under data parallelism: two Gloo ranks train like plain PyTorch.

A model with ``FusedLayerNorm`` and ``FusedRMSNorm`` whose norm ops run the CUDA kernels of
``csrc/cuda/layer_norm.cu`` (their emulated build: Gloo reduces CPU tensors) trains for a few
steps on two ranks under ``torch.nn.parallel.DistributedDataParallel``, each rank on its half
of the batch; the same model with ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` under DDP on
the same data is the reference. Both sets of kernels (``AMP_FUSED_OPS_NORM_KERNELS``) run,
with rows that the resident kernels take (1024 wide) and rows that only the per-row ones take
(1030 wide: not a multiple of the 16-byte vector); the ranks must end with the reference's
weights, and with each other's bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from amp_test_support import gloo_world_results

from _kernel_target import EMULATED, EMULATION, OnKernelsOf
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cuda_emulation,
    pytest.mark.skipif(
        not EMULATED, reason="Gloo reduces CPU tensors: runs the emulated kernels only"
    ),
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

WORLD = 2
STEPS = 3
BATCH = 8  # rows per step, half on each rank
CASES = [(kernels, width) for kernels in ("resident", "per_row") for width in (1024, 1030)]


def _model(fused: bool, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer_norm = FusedLayerNorm(width) if fused else torch.nn.LayerNorm(width)
    rms_norm = FusedRMSNorm(width, eps=1e-6) if fused else torch.nn.RMSNorm(width, eps=1e-6)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), layer_norm, torch.nn.GELU(), rms_norm, torch.nn.Linear(width, 4)
    )
    with torch.no_grad():  # parameters away from their initial ones and zeros
        for norm in (layer_norm, rms_norm):
            norm.weight.uniform_(0.5, 1.5)
        layer_norm.bias.uniform_(-0.5, 0.5)
    return model


def _train(fused: bool, width: int) -> list[torch.Tensor]:
    model = _model(fused, width)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    half = slice(dist.get_rank() * BATCH // 2, (dist.get_rank() + 1) * BATCH // 2)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x[half]), y[half]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int) -> dict[str, Any]:
    from amp_fused_ops.emulation import _kernels as _emulation

    _emulation.load(EMULATION)  # the build the parent compiled, from the cache
    results: dict[str, Any] = {}
    for kernels, width in CASES:
        os.environ["AMP_FUSED_OPS_NORM_KERNELS"] = kernels
        with OnKernelsOf("amp_fused_ops_emu") as routed:
            results[f"{kernels}-{width}"] = _train(fused=True, width=width)
        results[f"{kernels}-{width}-calls"] = dict(routed.calls)
    for width in {w for _, w in CASES}:
        results[f"reference-{width}"] = _train(fused=False, width=width)
    return results


@pytest.fixture(scope="module")
def world_results() -> list[dict[str, Any]]:
    from amp_fused_ops.emulation import _kernels as _emulation

    _emulation.load(EMULATION)  # compiled once here, not by both ranks at once
    return gloo_world_results(_worker, WORLD)


@pytest.mark.parametrize(("kernels", "width"), CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_the_cuda_norm_kernels_train_on_two_ranks_as_torch_norms_do(
    world_results: list[dict[str, Any]], kernels: str, width: int
) -> None:
    reference = world_results[0][f"reference-{width}"]
    initial = [p.detach() for p in _model(fused=False, width=width).parameters()]
    assert all(not torch.equal(w, i) for w, i in zip(reference, initial, strict=True))
    for rank, results in enumerate(world_results):
        calls = results[f"{kernels}-{width}-calls"]
        assert calls["norm_forward"] == calls["norm_backward"] == 2 * STEPS, calls
        got = results[f"{kernels}-{width}"]
        for index, (mine, rank0) in enumerate(zip(got, world_results[0][f"{kernels}-{width}"],
                                                  strict=True)):  # fmt: skip
            assert torch.equal(mine, rank0), f"rank {rank} and rank 0 differ at parameter {index}"
        for index, (mine, want) in enumerate(zip(got, reference, strict=True)):
            # float32 sums over 1024-1030 columns in another order than torch's, three steps
            torch.testing.assert_close(
                mine, want, rtol=1e-4, atol=2e-5,
                msg=lambda m, r=rank, i=index: f"rank {r}, parameter {i}: {m}",
            )  # fmt: skip
