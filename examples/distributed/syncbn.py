"""SyncBatchNorm across ranks, launched by torchrun (CPU/Gloo or GPU/NCCL).

Ranks hold different batch sizes. A convnet converted with ``convert_syncbn_model`` runs one
training forward/backward under DistributedDataParallel; the script checks on every rank
that the batch-norm output and running statistics equal a plain ``BatchNorm2d`` applied to
the concatenated batch of all ranks, and exits non-zero otherwise.

Usage:
    torchrun --nproc-per-node 2 examples/distributed/syncbn.py [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist

from amp_parallel import DistributedDataParallel, convert_syncbn_model

LOG = logging.getLogger("syncbn")


def require_torchrun(script: str) -> None:
    """Exit with the command to use when the script was not started by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit(
            f"{script} runs one process per rank: start it with torchrun, e.g.\n"
            f"    torchrun --nproc-per-node 2 {script}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=None, help="image height and width (8)")
    parser.add_argument("--smoke", action="store_true", help="4x4 images (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = 4 if args.smoke else 8
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    require_torchrun("examples/distributed/syncbn.py")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8))
    reference = torch.nn.BatchNorm2d(8).to(device)
    net = convert_syncbn_model(net).to(device)
    model = DistributedDataParallel(net)

    sizes = [2 + 3 * r for r in range(world)]  # unequal per-rank batch sizes
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(sum(sizes), 3, args.size, args.size, generator=gen).to(device)
    start = sum(sizes[:rank])
    out = model(full[start : start + sizes[rank]])
    out.float().square().mean().backward()

    with torch.no_grad():
        expected = reference(net[0](full))[start : start + sizes[rank]]
    checks = {
        "output": torch.allclose(out, expected, atol=1e-4, rtol=1e-4),
        "running_mean": torch.allclose(net[1].running_mean, reference.running_mean, atol=1e-5),
        "running_var": torch.allclose(net[1].running_var, reference.running_var, atol=1e-5),
    }
    ok = torch.tensor([int(all(checks.values()))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        LOG.info(
            "world %d, batch sizes %s: SyncBatchNorm == BatchNorm on the full batch: %s",
            world,
            sizes,
            bool(ok.item()),
        )
    # Free what holds the process group (the DDP reducer above all) before destroying it, so
    # no Gloo thread outlives the group and aborts the process at interpreter exit.
    del model, net
    gc.collect()
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    if not ok.item():
        LOG.error("rank %d: %s", rank, checks)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
