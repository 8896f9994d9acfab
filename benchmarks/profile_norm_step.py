"""Where a fused norm's forward + backward spends host time that torch's does not.

Profiles a few steps of ``y = norm(x)`` then ``torch.autograd.grad(y, (x, *params), dy)`` with
``torch.profiler`` for ``FusedLayerNorm`` / ``FusedRMSNorm`` and for torch's modules, and prints
per step: the ops called (with their self CPU time), the kernels launched, the device time, and
the wall time of an unprofiled step. A diagnostic, not a benchmark: profiling slows every call.

Usage:
    python benchmarks/profile_norm_step.py --device cuda                  # hidden 1024, bf16
    python benchmarks/profile_norm_step.py --device cuda --hidden 4096 --norm rms_norm
    python benchmarks/profile_norm_step.py --device cpu --rows 64

Never asserts anything; prints only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from amp_fused_ops import FusedLayerNorm, FusedRMSNorm


def modules(norm: str, hidden: int) -> dict[str, nn.Module]:
    """The fused module and torch's, with the same parameters."""
    if norm == "layer_norm":
        return {"ours": FusedLayerNorm(hidden), "torch": nn.LayerNorm(hidden)}
    return {"ours": FusedRMSNorm(hidden), "torch": nn.RMSNorm(hidden)}


def report(name: str, module: nn.Module, x: torch.Tensor, dy: torch.Tensor, steps: int) -> None:
    """Print the profile of ``steps`` steps of ``module`` and the wall time of one."""
    inputs = (x, *module.parameters())

    def step() -> None:
        torch.autograd.grad(module(x), inputs, dy)

    for _ in range(5):
        step()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall_us = (time.perf_counter() - start) / steps * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    events = prof.key_averages()
    print(f"\n== {name}: {type(module).__name__}, wall {wall_us:.1f} us per step (unprofiled)")
    header = ("op / kernel", "calls/step", "self CPU us/step", "device us/step")
    print(f"{header[0]:60s} {header[1]:>10s} {header[2]:>17s} {header[3]:>15s}")
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in rows:
        device_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        if e.self_cpu_time_total == 0 and device_us == 0:
            continue
        print(
            f"{e.key[:60]:60s} {e.count / steps:10.1f} {e.self_cpu_time_total / steps:17.1f} "
            f"{device_us / steps:15.1f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--norm", choices=("layer_norm", "rms_norm"), default="layer_norm")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_norm_step: CUDA is not available; nothing profiled.")
        return 0
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.hidden, generator=gen).to(args.device, dtype)
    x.requires_grad_()
    dy = torch.randn(args.rows, args.hidden, generator=gen).to(args.device, dtype)
    print(
        f"torch {torch.__version__}, {args.device}, {args.norm} {args.dtype} "
        f"{args.rows}x{args.hidden}, {args.steps} steps"
    )
    for name, module in modules(args.norm, args.hidden).items():
        report(name, module.to(args.device, dtype), x, dy, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
