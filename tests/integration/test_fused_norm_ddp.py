"""Fused norms under data parallelism: two Gloo ranks train like plain PyTorch.

A model with ``FusedLayerNorm`` and ``FusedRMSNorm`` (their autograd formula and CPU kernels
in the C++ extension) is trained for a few steps on two ranks, each on its half of the batch,
under ``torch.nn.parallel.DistributedDataParallel`` and under amp-parallel's; the same model
with ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` under plain DDP on the same data is the
reference. Every rank must end with the reference's weights. A second run feeds the
LayerNorm a bfloat16 input (float32 parameters, the half-input path of the CPU kernel): the
ranks must agree bit for bit and stay within bfloat16's rounding of plain PyTorch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from amp_test_support import gloo_world_results

from amp_fused_ops import FusedLayerNorm, FusedRMSNorm
from amp_parallel import DistributedDataParallel as ApexDDP

WORLD = 2
STEPS = 3


class _Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _model(fused: bool, norm_input: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layer_norm = FusedLayerNorm(16) if fused else torch.nn.LayerNorm(16)
    rms_norm = FusedRMSNorm(16, eps=1e-6) if fused else torch.nn.RMSNorm(16, eps=1e-6)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), _Cast(norm_input), layer_norm, _Cast(torch.float32),
        torch.nn.GELU(), torch.nn.Linear(16, 16), rms_norm, torch.nn.Linear(16, 4),
    )  # fmt: skip
    with torch.no_grad():  # parameters away from their initial ones and zeros
        for norm in (layer_norm, rms_norm):
            norm.weight.uniform_(0.5, 1.5)
        layer_norm.bias.uniform_(-0.5, 0.5)
    return model


def _train(
    fused: bool, wrapper: str, norm_input: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    model = _model(fused, norm_input)
    wrapped = (
        ApexDDP(model)
        if wrapper == "amp_parallel"
        else (torch.nn.parallel.DistributedDataParallel(model))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        half = slice(rank * 4, rank * 4 + 4)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x[half]), y[half]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int) -> dict[str, list[torch.Tensor]]:
    return {
        "reference": _train(fused=False, wrapper="torch"),
        "torch": _train(fused=True, wrapper="torch"),
        "amp_parallel": _train(fused=True, wrapper="amp_parallel"),
        "reference_bf16": _train(False, "torch", torch.bfloat16),
        "torch_bf16": _train(True, "torch", torch.bfloat16),
        "amp_parallel_bf16": _train(True, "amp_parallel", torch.bfloat16),
    }


@pytest.fixture(scope="module")
def world_results() -> list[dict[str, Any]]:
    return gloo_world_results(_worker, WORLD)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", ["torch", "amp_parallel"])
def test_fused_norms_train_on_two_ranks_as_torch_norms_do(
    world_results: list[dict[str, Any]], wrapper: str
) -> None:
    reference = world_results[0]["reference"]
    initial = [p.detach() for p in _model(fused=False).parameters()]
    assert all(not torch.equal(w, i) for w, i in zip(reference, initial, strict=True))
    for rank, results in enumerate(world_results):
        for index, (got, want) in enumerate(zip(results[wrapper], reference, strict=True)):
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-6,
                msg=lambda m, r=rank, i=index: f"rank {r}, parameter {i}: {m}",
            )  # fmt: skip


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", ["torch", "amp_parallel"])
def test_a_bfloat16_input_trains_alike_on_both_ranks_and_as_torch_norms_do(
    world_results: list[dict[str, Any]], wrapper: str
) -> None:
    reference = world_results[0]["reference_bf16"]
    first = world_results[0][f"{wrapper}_bf16"]
    for rank, results in enumerate(world_results):
        for index, (got, want) in enumerate(zip(results[f"{wrapper}_bf16"], first, strict=True)):
            assert torch.equal(got, want), f"rank {rank} and rank 0 differ at parameter {index}"
    for index, (got, want) in enumerate(zip(first, reference, strict=True)):
        # bfloat16's rounding of the norm's input and output, carried over three steps
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2, msg=f"parameter {index}")
