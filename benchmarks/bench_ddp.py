"""Step time of amp_parallel.DistributedDataParallel vs torch's DistributedDataParallel.

Two ranks (Gloo on CPU, NCCL on CUDA with two GPUs) train the same MLP; a step is forward,
loss, backward (with the gradient all-reduce) and an SGD step. Both wrappers are built in
the same processes and timed in alternating rounds; the median step time over all rounds is
reported, with the ratio amp/torch beside the goal (<= 1.1x).

Usage:
    python benchmarks/bench_ddp.py --device cpu [--iters 30 --rounds 5]

Prints a table and writes ``benchmarks/out/ddp_<device>.json``. Never asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

LOG = logging.getLogger("bench_ddp")
GOAL = 1.1


def _model(hidden: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, hidden), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, 10))
    return torch.nn.Sequential(*layers).to(device)


def _time_steps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, iters: int) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(3):  # warm-up (and torch's bucket rebuild after the first step)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    sync()
    return (time.perf_counter() - start) / iters


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, out: Any) -> None:
    from amp_parallel import DistributedDataParallel as AmpDDP

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world
    )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 256, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    ids = [rank] if cuda else None
    times: dict[str, list[float]] = {"amp_parallel": [], "torch": []}
    for _ in range(args.rounds):
        amp_net = AmpDDP(_model(args.hidden, device))
        times["amp_parallel"].append(_time_steps(amp_net, x, y, args.iters))
        torch_net = torch.nn.parallel.DistributedDataParallel(
            _model(args.hidden, device), device_ids=ids
        )
        times["torch"].append(_time_steps(torch_net, x, y, args.iters))
    if rank == 0:
        params = sum(p.numel() for p in amp_net.parameters())
        out.put({"params": params, "times": times})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world = 2
    if args.device == "cuda" and torch.cuda.device_count() < world:
        # Not an error: `nox -s bench` runs every script on CUDA whenever one GPU exists.
        LOG.warning(
            "skipped: --device cuda needs %d GPUs for %d NCCL ranks, found %d",
            world,
            world,
            torch.cuda.device_count(),
        )
        return 0
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(prefix="bench_ddp_"), "store")
    procs = [ctx.Process(target=_worker, args=(r, world, init, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    ratio = med["amp_parallel"] / med["torch"]
    LOG.info(
        "DDP step, %d %s ranks, MLP %d params, batch %d per rank",
        world,
        args.device,
        result["params"],
        args.batch,
    )
    LOG.info("%-14s %12s", "wrapper", "step (ms)")
    for name, t in med.items():
        LOG.info("%-14s %12.3f", name, t * 1e3)
    LOG.info("ratio amp_parallel / torch: %.3fx (goal <= %.1fx)", ratio, GOAL)
    record = {
        "benchmark": "ddp_step",
        "device": args.device,
        "world_size": world,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "params": result["params"],
        "batch_per_rank": args.batch,
        "iters": args.iters,
        "rounds": args.rounds,
        "median_step_s": med,
        "all_step_s": result["times"],
        "ratio_amp_over_torch": ratio,
        "goal_ratio": GOAL,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = Path(__file__).resolve().parent / "out" / f"ddp_{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    LOG.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
