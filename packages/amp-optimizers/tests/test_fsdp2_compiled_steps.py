"""``torch.compile(optimizer.step)`` of FusedLAMB and FusedNovoGrad on FSDP2 params: two Gloo ranks.

Their norms span the shards (test_fsdp2_layerwise.py), all-reduced in the ops' PyTorch
reference; under ``torch.compile`` with DTensor params that step runs as in eager mode, at one
graph break. Traced instead, it broke the graph inside its loops, recompiled every step (the
step count became a constant) and created state of uneven shards with the other rank's local
shape ("has 81 elements but ... 72", "incorrect fake kernel"). The sizes here do not divide by
the world size; the compiled sharded step must give the params of the eager unsharded one
(within the float32 rounding of the sharded norms) with no recompilation after the second
step (the first creates the state).
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

from amp_optimizers import FusedLAMB, FusedNovoGrad

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 4
RTOL, ATOL = 1e-5, 1e-6  # the sharded norms' float32 rounding (test_fsdp2_layerwise.py)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 17 rows: shards of 9 and 8 rows, the sizes the traced step confused.
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))


def _train(model: torch.nn.Module, step: Callable[[], Any]) -> list[int]:
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = None
        model(torch.randn(6, 9, generator=gen)).square().mean().backward()
        step()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for name, make in OPTIMIZERS.items():
            torch._dynamo.reset()
            reference = _model()
            eager = make(list(reference.parameters()))
            _train(reference, eager.step)
            sharded = _model()
            for layer in sharded:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(sharded)
            optimizer = make(list(sharded.parameters()))
            graphs = _train(sharded, torch.compile(optimizer.step))
            assert graphs[1:] == [graphs[1]] * (STEPS - 1), (name, graphs)
            for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
                assert isinstance(p, DTensor)
                torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=RTOL, atol=ATOL,
                                           msg=name)  # fmt: skip
                # The state has the param's local shape on every rank.
                moment = optimizer.state[p]["exp_avg"]
                assert isinstance(moment, DTensor), name
                assert moment.to_local().shape == p.to_local().shape, name
            assert int(optimizer.param_groups[0]["step"]) == STEPS, name
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_compiled_steps_of_layerwise_optimizers_on_uneven_fsdp2_shards() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
