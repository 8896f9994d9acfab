"""FP16_Optimizer with PyTorch's DistributedDataParallel, launched by torchrun.

Each rank trains the same half model on its own shard of the data; DDP averages the (scaled)
half gradients, FP16_Optimizer unscales them into the fp32 masters. At the end every rank
checks that its parameters equal rank 0's. Gloo on CPU (bf16 by default), NCCL on GPU (fp16).

Usage:
    torchrun --nproc-per-node 2 examples/fp16_optimizer/distributed.py [--dtype bf16|fp16] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from amp_legacy_fp16 import FP16_Optimizer, convert_network

LOG = logging.getLogger("distributed")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def require_torchrun(script: str) -> None:
    """Exit with the command to use when the script was not started by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit(
            f"{script} runs one process per rank: start it with torchrun, e.g.\n"
            f"    torchrun --nproc-per-node 2 {script}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "fp16" if torch.cuda.is_available() else "bf16"
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 10)")
    parser.add_argument("--smoke", action="store_true", help="3 steps (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.smoke else 10
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    require_torchrun("examples/fp16_optimizer/distributed.py")
    warnings.simplefilter("ignore", FutureWarning)  # this example uses the legacy API on purpose
    dtype = DTYPES[args.dtype]

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(
        device
    )
    model = convert_network(model, dtype)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = FP16_Optimizer(
        torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**16},
        verbose=False,
    )

    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own shard
        x = torch.randn(32, 8, generator=g).to(device)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(x.to(dtype)).float(), y)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())

    # Every rank must hold exactly rank 0's parameters.
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = bool(torch.equal(flat, reference))
    if rank == 0:
        LOG.info(
            "world %d, %s: loss %.4f -> %.4f, ranks in sync: %s",
            world,
            dtype,
            losses[0],
            losses[-1],
            same,
        )
    flags = torch.tensor([0.0 if same else 1.0], device=device)
    dist.all_reduce(flags)
    ok = flags.item() == 0
    # Free what holds the process group (the DDP reducer above all) before destroying it, so
    # no Gloo thread outlives the group and aborts the process at interpreter exit.
    del ddp_model, model, optimizer
    gc.collect()
    dist.barrier()  # no rank tears Gloo down while another still talks to it
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
