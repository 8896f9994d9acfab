"""Fused norms under data parallelism: two Gloo ranks train like plain PyTorch.

A model with ``FusedLayerNorm`` and ``FusedRMSNorm`` (their autograd formula and CPU kernels
in the C++ extension) is trained for a few steps on two ranks, each on its half of the batch,
under ``torch.nn.parallel.DistributedDataParallel`` and under amp-parallel's; the same model
with ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` under plain DDP on the same data is the
reference. Every rank must end with the reference's weights. A second run feeds the
LayerNorm a bfloat16 input (float32 parameters, the half-input path of the CPU kernel): the
ranks must agree bit for bit and stay within bfloat16's rounding of plain PyTorch. A third
saves the norms' outputs (``memory_efficient``: the backward recomputes the normalized input
from them): the ranks must agree bit for bit and stay within float32's rounding of the
reference.
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


def _model(
    fused: bool, norm_input: torch.dtype = torch.float32, memory_efficient: bool = False
) -> torch.nn.Module:
    torch.manual_seed(0)
    me = {"memory_efficient": memory_efficient}
    layer_norm = FusedLayerNorm(16, **me) if fused else torch.nn.LayerNorm(16)
    rms_norm = FusedRMSNorm(16, eps=1e-6, **me) if fused else torch.nn.RMSNorm(16, eps=1e-6)
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
    fused: bool,
    wrapper: str,
    norm_input: torch.dtype = torch.float32,
    memory_efficient: bool = False,
) -> list[torch.Tensor]:
    model = _model(fused, norm_input, memory_efficient)
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
        "torch_me": _train(True, "torch", memory_efficient=True),
        "amp_parallel_me": _train(True, "amp_parallel", memory_efficient=True),
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


def _assert_ranks_agree_and_near_the_reference(
    world_results: list[dict[str, Any]], key: str, tol: dict[str, float]
) -> None:
    """Every rank's ``key`` weights equal rank 0's bit for bit, and rank 0's are within
    ``tol`` of the reference run of the same input dtype."""
    first = world_results[0][key]
    for rank, results in enumerate(world_results):
        for index, (got, want) in enumerate(zip(results[key], first, strict=True)):
            assert torch.equal(got, want), f"rank {rank} and rank 0 differ at parameter {index}"
    reference = world_results[0]["reference_bf16" if key.endswith("_bf16") else "reference"]
    for index, (got, want) in enumerate(zip(first, reference, strict=True)):
        torch.testing.assert_close(got, want, **tol, msg=f"parameter {index}")


# The run and its tolerance to the reference, over three steps: bfloat16's rounding of the
# norm's input and output; float32's of the normalized input recomputed from the output.
_VARIANTS = {"bf16": {"rtol": 1.6e-2, "atol": 1e-2}, "me": {"rtol": 1e-5, "atol": 1e-5}}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", ["torch", "amp_parallel"])
@pytest.mark.parametrize("variant", list(_VARIANTS), ids=["bfloat16_input", "memory_efficient"])
def test_a_variant_trains_alike_on_both_ranks_and_as_torch_norms_do(
    world_results: list[dict[str, Any]], wrapper: str, variant: str
) -> None:
    _assert_ranks_agree_and_near_the_reference(
        world_results, f"{wrapper}_{variant}", _VARIANTS[variant]
    )
