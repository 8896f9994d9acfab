"""The element-wise fused optimizers on FSDP2 (DTensor) parameters, two Gloo ranks on the CPU.

FusedAdam, FusedSGD and FusedAdagrad step each rank's local shards through the multi-tensor
kernels; the parameters after a few steps equal those of the same optimizer on the unsharded
model (both ranks see the same batches, so FSDP2's averaged gradients are the unsharded ones).
Capturable FusedAdam skips a step whose gradients hold an inf or a nan: the ranks agree on
that before stepping, so an inf in one rank's shard skips the step on both. An op that raises
its flag from the values each rank reads (multi_tensor_scale) refuses DTensors with an error
that names the optimizers that work (those that reduce over whole tensors are tested in
test_fsdp2_layerwise.py).
"""

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

from amp_fused_ops import amp_C, multi_tensor_applier
from amp_optimizers import FusedAdagrad, FusedAdam, FusedSGD

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 3

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "FusedAdam_l2": lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=False, weight_decay=0.01),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
    "FusedAdam_capturable": lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
    "FusedAdam_master": lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Sizes that do not divide evenly by the world size: FSDP2 pads the last shard.
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 9, generator=gen) for _ in range(STEPS)]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for x in _batches():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for name, make in OPTIMIZERS.items():
            reference = _model()
            _train(reference, make(list(reference.parameters())))
            sharded = _model()
            for layer in sharded:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(sharded)
            optimizer = make(list(sharded.parameters()))
            _train(sharded, optimizer)
            for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
                assert isinstance(p, DTensor)
                torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=0,
                                           msg=name)  # fmt: skip
            # The state is sharded as the parameters are (what distributed checkpoints save).
            state = [v for s in optimizer.state.values() for v in s.values()]
            assert any(isinstance(v, DTensor) for v in state), name
        # Capturable: an inf in rank 1's shard only skips the step on both ranks.
        sharded = _model()
        fully_shard(sharded)
        optimizer = FusedAdam(list(sharded.parameters()), lr=1e-2, capturable=True)
        before = [p.full_tensor().clone() for p in sharded.parameters()]
        sharded(_batches()[0]).sum().backward()
        if dist.get_rank() == 1:
            next(iter(sharded.parameters())).grad.to_local()[0, 0] = float("inf")
        optimizer.step()
        for p, old in zip(sharded.parameters(), before, strict=True):
            torch.testing.assert_close(p.full_tensor(), old, rtol=0, atol=0)
        assert int(optimizer.param_groups[0]["step"]) == 0
        # An op that raises its flag from the values each rank reads refuses DTensors.
        shards = [p.grad for p in sharded.parameters()]
        try:
            multi_tensor_applier(amp_C.multi_tensor_scale, torch.zeros(1, dtype=torch.int32),
                                 [shards, shards], 1.0)  # fmt: skip
        except NotImplementedError as error:
            assert "DTensor (sharded) arguments" in str(error), error
            assert "FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB" in str(error), error
        else:
            raise AssertionError("multi_tensor_scale took DTensor arguments")
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fused_optimizers_step_fsdp2_shards_as_the_unsharded_model() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
