"""The loss scaler on DTensor (FSDP2) gradients: unscaled shard by shard, one overflow flag.

Two Gloo ranks hold one shard each of the same gradients; rank 1's shard holds an inf. Both
ranks must see ``found_inf`` raised (and skip the step), through each way the scaler checks a
group: PyTorch's fused check-and-unscale, the max-norm check used where that op has no kernel
(CUDA bfloat16, for one), and the check of a static scale of one.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from amp_test_support import exit_passed_rank

from amp_core._scaler import _NO_FUSED_UNSCALE, LossScaler

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2


def _check(path: str, dtype: torch.dtype) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 3, generator=gen).to(dtype), torch.randn(5, generator=gen).to(dtype)]
    scale = 1.0 if path == "static one" else 8.0
    for inf_rank in (None, 1):
        grads = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in full]
        if dist.get_rank() == inf_rank:
            grads[1].to_local()[0] = math.inf
        scaler = LossScaler(scale if path == "static one" else "dynamic", init_scale=scale)
        found_inf = torch.zeros(())
        key = ("cpu", dtype)
        fallback = path == "max-norm" and key not in _NO_FUSED_UNSCALE
        if fallback:
            _NO_FUSED_UNSCALE.add(key)
        try:
            scaler.unscale_(grads, found_inf, check=True)
        finally:
            if fallback:
                _NO_FUSED_UNSCALE.discard(key)
        name = f"{path} {dtype} inf on rank {inf_rank}"
        assert found_inf.item() == (0.0 if inf_rank is None else 1.0), name
        if inf_rank is None:
            for g, t in zip(grads, full, strict=True):
                expected = (t.float() / scale).to(dtype)  # a power of two: exact
                torch.testing.assert_close(g.full_tensor(), expected, rtol=0, atol=0, msg=name)


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        for path in ("fused", "max-norm", "static one"):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                _check(path, dtype)
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_overflow_in_one_ranks_shard_is_found_on_every_rank() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
