"""Where an amp O1 step spends the time that the same step under torch.autocast does not.

Runs the MLP step of ``bench_amp_step.py --compare`` under ``torch.autocast`` and under amp O1
(with the loss scale given), profiles a few steps of each with ``torch.profiler``, and prints
the aten ops whose call count or self CPU time differ, then the amp-core Python functions by
their own time (``cProfile``). A diagnostic, not a benchmark: profiling slows every call.

Usage:
    python benchmarks/profile_o1_step.py --loss-scale dynamic
    python benchmarks/profile_o1_step.py --device cuda --half-dtype float16  # host side on a GPU
    python benchmarks/profile_o1_step.py --loss-scale 1.0 --threads 1 --steps 20

Never asserts anything; prints only.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from _common import Step, cpu_flags, format_cpu_flags, load_average
from amp_core import amp
from bench_amp_step import MlpConfig, mlp_autocast_step, mlp_o1_step


def op_table(step: Step, steps: int) -> dict[str, tuple[int, float]]:
    """``{aten op: (calls, self CPU microseconds)}`` over ``steps`` calls of ``step`` (on a GPU
    too: the host's time, which is what O1 adds)."""
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--loss-scale", default="dynamic", help='"dynamic" or a number')
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--half-dtype", choices=("float16", "bfloat16"), default="bfloat16")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    half = getattr(torch, args.half_dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_o1_step: CUDA is not available; nothing profiled on cuda.")
        return 0
    device = torch.device(args.device)
    cfg = MlpConfig()
    gen = torch.Generator().manual_seed(0)
    data = (
        torch.randn(cfg.batch, cfg.dim, generator=gen).to(device),
        torch.randn(cfg.batch, cfg.dim).to(device),
    )
    print(
        f"{args.device}, {args.half_dtype}, {args.threads} thread(s), loss scale "
        f"{args.loss_scale}, load average {load_average()}"
        f"\nCPU flags: {format_cpu_flags(cpu_flags())}"
    )
    autocast = op_table(mlp_autocast_step(cfg, device, 0, data, half), args.steps)
    o1_step = mlp_o1_step(cfg, device, 0, data, half, args.loss_scale)
    o1 = op_table(o1_step, args.steps)
    rows = []
    for key in sorted(set(autocast) | set(o1)):
        (n_a, t_a), (n_o, t_o) = autocast.get(key, (0, 0.0)), o1.get(key, (0, 0.0))
        if n_a != n_o or abs(t_o - t_a) > 0.05 * max(t_a, 1.0):
            rows.append((t_o - t_a, key, n_a, n_o, t_a, t_o))
    print(f"\nper step: {'op':<58}{'calls ac':>9}{'calls O1':>9}{'us ac':>9}{'us O1':>9}")
    for _, key, n_a, n_o, t_a, t_o in sorted(rows, reverse=True)[:30]:
        s = args.steps
        print(
            f"          {key[:58]:<58}{n_a / s:>9.1f}{n_o / s:>9.1f}{t_a / s:>9.0f}{t_o / s:>9.0f}"
        )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        o1_step()
    prof.disable()
    amp.close()
    print("\namp-core's own Python time in the O1 steps (cProfile):")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats("amp_core", 15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
