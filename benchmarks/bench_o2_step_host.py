"""Host time of amp O2's ``optimizer.step()`` with FusedAdam: the cached layout against the
lists gathered at every step.

Under ``opt_level="O2"`` a ``FusedAdam`` steps its float32 masters and writes the half model
in one fused pass per param group (amp-core's fused master-weight path). Its lists come from
each group's cached layout, or, where a master holds a gradient (amp put unscaled gradients
there, e.g. for clipping through ``amp.master_params``), are gathered at that step. The
variants, on the same model (``--layers`` ``Linear(--width, --width)`` layers, two params each,
in bfloat16), interleaved by rounds:

- ``cached layout``: ``FusedAdam`` as shipped;
- ``gathered per step``: the same with ``_plans_device_path`` off, every step gathering its
  lists in Python (the path before the layout was cached).

Each timed step follows a forward and a backward (outside the timing): only
``optimizer.step()`` is timed, which includes amp's bookkeeping around the fused step (the
half params' edit stamps, the skip decided on the device). On CUDA the time is host time, the
device synchronized after each step outside the timing.

Usage:
    python benchmarks/bench_o2_step_host.py
    python benchmarks/bench_o2_step_host.py --layers 50 --threads 1

Prints a table and writes ``benchmarks/out/o2_step_host.json``. Never asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from _common import (
    cpu_flags,
    default_threads,
    device_name,
    format_cpu_flags,
    load_average,
    sync,
)
from amp_core import amp
from amp_optimizers import FusedAdam

LOG = logging.getLogger("bench_o2_step_host")
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
VARIANTS = {"cached layout": True, "gathered per step": False}


def make_run(cached: bool, args: argparse.Namespace) -> Any:
    """A model under O2 with FusedAdam, and a callable that times one step after a backward."""
    torch.manual_seed(args.seed)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers).to(args.device)
    optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    optimizer._plans_device_path = cached
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = amp.initialize(
            model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0
        )
    x = torch.randn(4, args.width, device=args.device)

    def timed_step() -> float:
        optimizer.zero_grad()
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        sync(args.device)
        begin = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - begin
        sync(args.device)
        return elapsed * 1e6

    return timed_step


def run(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        LOG.info("round %d/%d", round_index + 1, args.rounds)
        for name in names if round_index % 2 == 0 else names[::-1]:
            timed_step = make_run(VARIANTS[name], args)
            for _ in range(args.warmup):
                timed_step()
            times[name] += [timed_step() for _ in range(args.iters)]
    return {
        "params": 2 * args.layers,
        "median_us": {name: statistics.median(t) for name, t in times.items()},
        "min_us": {name: min(t) for name, t in times.items()},
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"amp O2 FusedAdam step, {result['params']} params (bfloat16 model, float32 masters)",
        f"{'variant':<20}{'median us':>11}{'min us':>9}",
    ]
    for name, median in result["median_us"].items():
        lines.append(f"{name:<20}{median:>11.1f}{result['min_us'][name]:>9.1f}")
    base = result["median_us"]["gathered per step"]
    lines.append(f"cached / gathered: {result['median_us']['cached layout'] / base:.3f}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=50, help="Linear layers (2 params each)")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per round")
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
    result = run(args)
    flags = cpu_flags() if args.device == "cpu" else {}
    record = {
        "benchmark": "o2_step_host",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": args.device,
        "device_name": device_name(args.device),
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "load_average": load_average(),
        "layers": args.layers,
        "width": args.width,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "result": result,
    }
    print(
        f"{record['device_name']} ({args.device}), {record['threads']} threads, "
        f"torch {torch.__version__}, load average {record['load_average']}"
    )
    if flags:
        print(f"CPU flags: {format_cpu_flags(flags)}")
    print(format_table(result))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "o2_step_host.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
