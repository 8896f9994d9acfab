"""amp O2 + amp_parallel.DistributedDataParallel, launched by torchrun (CPU/Gloo or GPU/NCCL).

Each rank trains the same model on its own shard; amp O2 keeps a half model (bf16 on CPU,
fp16 on CUDA) and fp32 master weights in the optimizer; DDP averages the half gradients
during backward. At the end every rank checks that its master weights equal rank 0's and that
the loss went down; the script exits non-zero otherwise.

Usage:
    torchrun --nproc-per-node 2 examples/distributed/ddp_amp_o2.py [--steps 20] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from amp_core import amp
from amp_parallel import DistributedDataParallel

LOG = logging.getLogger("ddp_amp_o2")


def require_torchrun(script: str) -> None:
    """Exit with the command to use when the script was not started by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit(
            f"{script} runs one process per rank: start it with torchrun, e.g.\n"
            f"    torchrun --nproc-per-node 2 {script}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 20)")
    parser.add_argument("--smoke", action="store_true", help="5 steps (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.smoke else 20
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    require_torchrun("examples/distributed/ddp_amp_o2.py")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # Any seed works: the wrapper broadcasts rank 0's half weights and amp O2's fp32 masters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model = DistributedDataParallel(model)  # after amp.initialize, as with Apex

    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data shard
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=gen)
        y = x @ w_true
        loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())

    masters = torch.cat([p.detach().float().reshape(-1) for p in amp.master_params(optimizer)])
    reference = masters.clone()
    dist.broadcast(reference, src=0)
    same = torch.equal(masters, reference)
    improved = losses[-1] < losses[0]
    ok = torch.tensor([int(same and improved)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        LOG.info(
            "world %d, %s, loss %.4f -> %.4f, masters identical on all ranks: %s",
            world,
            next(model.parameters()).dtype,
            losses[0],
            losses[-1],
            bool(ok.item()),
        )
    # Free what holds the process group (the DDP reducer above all) before destroying it, so
    # no Gloo thread outlives the group and aborts the process at interpreter exit.
    del model, optimizer
    gc.collect()
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    if not ok.item():
        LOG.error("rank %d: identical=%s, loss improved=%s", rank, same, improved)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
