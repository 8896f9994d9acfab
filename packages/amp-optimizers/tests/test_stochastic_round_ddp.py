"""bfloat16 stochastic rounding under DDP, two Gloo ranks seeded differently (the usual
``torch.manual_seed(base + rank)``): each rank draws its own default rounding seed, and the
first step agrees on rank 0's, so the same all-reduced gradients round the same way and the
replicas stay bitwise equal (before, they drifted apart from the first step)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from amp_test_support import exit_passed_rank

from amp_optimizers import FusedAdam, FusedSGD

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 3
BF16 = torch.bfloat16

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, bf16_stochastic_round=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, bf16_stochastic_round=True),
}


def _worker(rank: int, init_file: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for name, make in OPTIMIZERS.items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5)
            ).to(BF16)
            torch.manual_seed(100 + rank)  # per-rank seeds, e.g. for data augmentation
            ddp = DistributedDataParallel(model)
            optimizer = make(ddp.parameters())
            for _ in range(STEPS):
                x = torch.randn(8, 13).to(BF16)  # each rank its own batch
                optimizer.zero_grad()
                ddp(x).float().square().mean().backward()
                optimizer.step()
            flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
            replicas = [torch.empty_like(flat) for _ in range(WORLD)]
            dist.all_gather(replicas, flat)
            differ = int((replicas[0] != replicas[1]).sum())
            assert differ == 0, f"{name}: {differ} of {flat.numel()} weights differ between ranks"
            seeds: list[Any] = [None] * WORLD
            seed = optimizer.state_dict()["param_groups"][0]["stochastic_round_seed"]
            dist.all_gather_object(seeds, seed)
            assert seeds[0] == seeds[1], f"{name}: rounding seeds {seeds}"
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_replicas_stay_bitwise_equal_with_per_rank_seeds() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
