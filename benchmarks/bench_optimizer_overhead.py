"""Time one optimizer step over many small tensors, where the Python layer is most of the step.

Variants, each over ``--tensors`` params of ``--numel`` elements (10, 100 and 1000 tensors by
default; float32, or ``--dtype bfloat16``; one param group, or ``--groups`` of them, the later
ones without weight decay), every param with a gradient:

- ``FusedAdam``: ``amp_optimizers.FusedAdam`` (AdamW mode), the ``optimizer.step()`` a user calls;
- ``FusedAdam (lists)``: the same, passing its tensor lists at every step instead of stepping
  on the lists the compiled kernels keep (for the A/B of the two);
- ``FusedAdam capturable``: ``capturable=True``, the device path (step count, lr and skip flag on
  the device) on each group's cached layout, and ``FusedAdam capt. (per step)`` beside it,
  gathering its lists at every step; ``FusedAdam master weights``: ``master_weights=True``
  (float32 masters of half params; float32 params are their own);
- ``torch fused``: ``torch.optim.AdamW(fused=True)``;
- ``torch foreach``: ``torch.optim.AdamW(foreach=True)``;
- ``FusedSGD``: ``amp_optimizers.FusedSGD`` with momentum, and ``torch SGD foreach`` beside it;
- ``FusedLAMB``: ``amp_optimizers.FusedLAMB`` (no torch equivalent; reported for its trend).

On CUDA each variant also gets its host time (``host us``): the step timed on the host with
the device idle before it, synchronized after it outside the timing, so what the Python, the
dispatcher and the launches cost apart from the kernels (goal: FusedAdam under 50 us at 100
tensors).

The params stay the same tensors between steps and their gradients are set once, so a step
does what a training step's ``optimizer.step()`` does after the first one (the first, which
creates the state, is a warm-up step). Rounds alternate the variants and rebuild them, so a
change of the machine's load shows in every variant; the median over all rounds is reported,
with its ratio to ``torch fused``.

Usage:
    python benchmarks/bench_optimizer_overhead.py
    python benchmarks/bench_optimizer_overhead.py --tensors 10 100 1000 --threads 1

Prints a table per tensor count and writes ``benchmarks/out/optimizer_overhead.json``. Never
asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from _common import (
    Step,
    cpu_flags,
    default_threads,
    device_name,
    format_cpu_flags,
    host_time_step,
    load_average,
    time_step,
)
from amp_optimizers import FusedAdam, FusedLAMB, FusedSGD

LOG = logging.getLogger("bench_optimizer_overhead")

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
GOAL_VARIANT = "FusedAdam"  # <= torch fused at every tensor count (docs/design.rst)
YARDSTICK = "torch fused"
HOST_GOAL_TENSORS, HOST_GOAL_US = 100, 50.0  # FusedAdam's host time per step on a GPU

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def _fused_adam_passing_lists(params: list[Tensor]) -> torch.optim.Optimizer:
    """FusedAdam that passes its lists to ``multi_tensor_adam`` at every step, as before the
    compiled kernels kept them (the A/B of docs/design.rst, decision 13)."""
    optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    optimizer._stores_step_plans = False
    return optimizer


def _fused_adam_capturable_per_step(params: list[Tensor]) -> torch.optim.Optimizer:
    """FusedAdam's device path (``capturable=True``) with its lists gathered in Python at every
    step, as before its layout was cached."""
    optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01, capturable=True)
    optimizer._plans_device_path = False
    return optimizer


VARIANTS: dict[str, OptimizerFactory] = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "FusedAdam (lists)": _fused_adam_passing_lists,
    "FusedAdam capturable": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, capturable=True),
    "FusedAdam capt. (per step)": _fused_adam_capturable_per_step,
    "FusedAdam master weights": lambda ps: FusedAdam(
        ps, lr=1e-3, weight_decay=0.01, master_weights=True
    ),
    "torch fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9),
    "torch SGD foreach": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-3),
}


def make_params(
    tensors: int, numel: int, device: str, seed: int, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    """``tensors`` params of ``numel`` elements and ``dtype``, each with a gradient."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(numel, generator=gen).to(device, dtype))
        p.grad = (1e-3 * torch.randn(numel, generator=gen)).to(device, dtype)
        params.append(p)
    return params


def param_groups(params: list[Tensor], groups: int) -> list[Tensor] | list[dict[str, Any]]:
    """``params`` as they are (one group), or split into ``groups`` consecutive param groups,
    the later ones without weight decay (as decay / no-decay groups are)."""
    if groups == 1:
        return params
    size = -(-len(params) // groups)
    chunks = [params[i : i + size] for i in range(0, len(params), size)]
    return [{"params": chunks[0]}] + [{"params": c, "weight_decay": 0.0} for c in chunks[1:]]


def optimizer_step(factory: OptimizerFactory, params: list[Tensor], groups: int = 1) -> Step:
    optimizer = factory(param_groups(params, groups))  # type: ignore[arg-type]

    def step() -> None:
        optimizer.step()

    return step


def run_count(tensors: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median step time of every variant at ``tensors`` tensors, interleaved by rounds."""
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    host: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        LOG.info("%d tensors, round %d/%d", tensors, round_index + 1, args.rounds)
        for name in order:
            dtype = getattr(torch, args.dtype)
            params = make_params(tensors, args.numel, args.device, args.seed, dtype)
            step = optimizer_step(VARIANTS[name], params, args.groups)
            times[name] += time_step(step, args.device, args.warmup, args.iters)
            if args.device == "cuda":  # the host's part alone (on the CPU it is the step)
                host[name] += host_time_step(step, args.device, 0, args.iters)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "tensors": tensors,
        "numel": args.numel,
        "groups": args.groups,
        "dtype": args.dtype,
        "median_ms": medians,
        "min_ms": {name: min(t) for name, t in times.items()},
        "vs_torch_fused": {name: m / medians[YARDSTICK] for name, m in medians.items()},
        "goal_met": medians[GOAL_VARIANT] <= medians[YARDSTICK],
    }
    if args.device == "cuda":
        result["host_median_ms"] = {name: statistics.median(t) for name, t in host.items()}
    return result


def format_table(result: dict[str, Any]) -> str:
    host = result.get("host_median_ms")
    columns = f"{'variant':<28}{'median us':>11}{'min us':>9}{'vs torch fused':>16}"
    if host is not None:
        columns += f"{'host us':>10}"
    lines = [
        f"{result['tensors']} tensors x {result['numel']} elements"
        + (f", {result['groups']} param groups" if result.get("groups", 1) > 1 else "")
        + (f", {result['dtype']}" if result.get("dtype", "float32") != "float32" else ""),
        columns,
        "-" * len(columns),
    ]
    for name, median in result["median_ms"].items():
        line = (
            f"{name:<28}{median * 1e3:>11.1f}{result['min_ms'][name] * 1e3:>9.1f}"
            f"{result['vs_torch_fused'][name]:>15.3f}x"
        )
        if host is not None:
            line += f"{host[name] * 1e3:>10.1f}"
        lines.append(line)
    met = "met" if result["goal_met"] else "NOT met"
    lines.append(f"goal: {GOAL_VARIANT} <= {YARDSTICK} (medians): {met}")
    if host is not None and result["tensors"] == HOST_GOAL_TENSORS:
        ours = host[GOAL_VARIANT] * 1e3
        met = "met" if ours < HOST_GOAL_US else "NOT met"
        lines.append(
            f"goal: {GOAL_VARIANT} host time < {HOST_GOAL_US:.0f} us at {HOST_GOAL_TENSORS} "
            f"tensors: {ours:.1f} us ({met})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--numel", type=int, default=64, help="elements per tensor")
    parser.add_argument("--groups", type=int, default=1, help="param groups the tensors form")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=4, help="repeats of the variant sequence")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads or default_threads())
    results = [run_count(n, args) for n in args.tensors]
    flags = cpu_flags() if args.device == "cpu" else {}
    record = {
        "benchmark": "optimizer_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": args.device,
        "device_name": device_name(args.device),
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "load_average": load_average(),
        "groups": args.groups,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "results": results,
    }
    print(
        f"{record['device_name']} ({args.device}), {record['threads']} threads, "
        f"torch {torch.__version__}, load average {record['load_average']}"
    )
    if flags:
        print(f"CPU flags: {format_cpu_flags(flags)}")
    for result in results:
        print(format_table(result))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "optimizer_overhead.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
