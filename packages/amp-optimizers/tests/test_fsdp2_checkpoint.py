"""Fused optimizer state under FSDP2 is DTensor, so torch.distributed.checkpoint reshards it.

Two Gloo ranks train an FSDP2 model a few steps and save model and optimizer state with DCP
(``get_state_dict``); one process loads the checkpoint into the unsharded model and a new
optimizer (``set_state_dict``) and trains on. The result is compared with an uninterrupted run
of the same optimizer on the unsharded model: bitwise for the element-wise optimizers (their
sharded steps are bitwise the unsharded ones, and the checkpoint round trip is exact), within
float32 rounding for those that take norms over shards (test_fsdp2_layerwise.py says why).
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

from amp_optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 2  # before the checkpoint, and again after it

# name: (make, (rtol, atol) of the resumed run against the uninterrupted one)
OPTIMIZERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], tuple[float, float]]] = {
    "FusedAdam": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01), (0.0, 0.0)),
    "FusedSGD": (lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9), (0.0, 0.0)),
    "FusedAdagrad": (lambda ps: FusedAdagrad(ps, lr=1e-2), (0.0, 0.0)),
    "FusedLAMB": (lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=0.05), (1e-5, 1e-6)),
    "FusedNovoGrad": (lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01), (1e-5, 1e-6)),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 9, generator=gen) for _ in range(2 * STEPS)]


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> None:
    for x in batches:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _save_worker(rank: int, init_file: str, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for name, (make, _) in OPTIMIZERS.items():
            model = _model()
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            optimizer = make(list(model.parameters()))
            _train(model, optimizer, _batches()[:STEPS])
            # Every state tensor shaped as its param is a DTensor sharded as the param.
            for p in model.parameters():
                assert isinstance(p, DTensor), name
                for key, value in optimizer.state[p].items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        assert isinstance(value, DTensor), (name, key)
                        assert value.placements == p.placements, (name, key)
                        assert value.device_mesh == p.device_mesh, (name, key)
                        assert value.shape == p.shape, (name, key)
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save(
                {"model": model_state, "optim": optim_state},
                checkpoint_id=os.path.join(folder, name),
            )
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_dcp_checkpoint_of_fsdp2_optimizer_state_resumes_unsharded() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_save_worker, args=(init_file, folder), nprocs=WORLD, join=True)
        for name, (make, (rtol, atol)) in OPTIMIZERS.items():
            reference = _model()
            _train(reference, make(list(reference.parameters())), _batches())

            # One process, no process group: the unsharded model loads the sharded checkpoint.
            model = _model()
            optimizer = make(list(model.parameters()))
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=os.path.join(folder, name))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            _train(model, optimizer, _batches()[STEPS:])
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
