"""What the tests of every package share (on ``sys.path`` through pytest's ``pythonpath``).

Helpers that several packages' tests need live here once, instead of a copy per package.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NoReturn

import pytest
import torch

__all__ = [
    "CHAIN_TOL",
    "DEVICES",
    "HALF_DTYPES",
    "OP_TOL",
    "exit_passed_rank",
    "gloo_world_results",
]

# The low-precision dtypes a test runs in, with short ids.
HALF_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]

# Same test bodies on both devices; the cuda variant is skipped without CUDA (each package's
# conftest also skips `gpu` tests without CUDA; this keeps a test module self-contained).
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

# One low-precision op against its float32 reference (the rtol is
# torch.testing.assert_close's default for the dtype).
OP_TOL = {
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}

# Results that chain a few low-precision ops (forward + backward + one optimizer step of a
# 2-layer net): each matmul rounds its output once, so the error is a small multiple of one
# op's bound.
CHAIN_TOL = {
    torch.float16: dict(rtol=1e-2, atol=5e-3),
    torch.bfloat16: dict(rtol=6e-2, atol=4e-2),
}


def exit_passed_rank() -> NoReturn:
    """End a spawned Gloo rank whose checks passed, without interpreter shutdown.

    DTensor's caches keep the device mesh, and through it the process group, alive past
    ``destroy_process_group``. A Gloo worker thread can then release the tensors of the last
    collective while the interpreter shuts down, and the process aborts ("terminate called
    without an active exception", PyTorch issue 190489): ``mp.spawn`` would report a rank
    that passed as failed. A rank that raised still exits through ``mp.spawn``, which
    reports its traceback.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_world_results(worker: Callable[[int], Any], world: int) -> list[Any]:
    """What ``worker(rank)`` returns on each of ``world`` spawned Gloo ranks, in rank order.

    Each rank runs with one CPU thread inside a process group (``gloo``, a file rendezvous in a
    temporary folder), which is destroyed after ``worker`` returns or raises; its result is
    saved with ``torch.save`` and read back here. ``worker`` must be a module-level function
    (spawned processes import it). A rank that raises fails the call with its traceback.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_gloo_rank, args=(worker, world, init_file, folder), nprocs=world, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


def _gloo_rank(rank: int, worker: Callable[[int], Any], world: int, init_file: str,
               out_dir: str) -> None:  # fmt: skip
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        torch.save(worker(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_passed_rank()
