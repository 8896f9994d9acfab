"""Global-memory bytes of a fused norm's forward + backward, counted by the CUDA emulator.

No GPU needed: the CUDA kernels of ``csrc/cuda/layer_norm.cu`` run on the CPU through the
emulator's counting build (``amp_fused_ops.emulation``), which counts every byte a kernel
thread reads or writes in global memory. A norm is memory-bound on a GPU, so its time there
is about these bytes over the bandwidth.

For LayerNorm and RMSNorm in float32, bfloat16 and float16 (parameters in the input's dtype)
and every hidden size of a bucket from 512 to 16384, one ``norm_forward`` and one
``norm_backward`` (input saved, not the output) of ``--rows`` rows are counted, against the
minimum: five passes over the activations (the forward reads ``x`` and writes ``y``; the
backward reads ``x`` and ``dy`` and writes ``dx``), plus the parameters (read by each
direction, their gradients written once) and the per-row statistics (written by the forward,
read by the backward). ``vs min`` above 1 is traffic a kernel could save: a second read of a
row, or partial sums of the parameter gradients written and read again.

Usage:
    python benchmarks/bench_norm_bytes.py [--rows 256] [--hidden 512 1024 ...]

Compiles the emulated extension on first use (minutes). Prints a table and writes
``benchmarks/out/norm_bytes.json``. Never asserts anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import amp_fused_ops
from amp_fused_ops import emulation

HIDDEN = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATS_BYTES = 4  # mean and invvar are float32


@dataclass
class Row:
    norm: str
    dtype: str
    hidden: int
    rows: int
    forward_bytes: int
    backward_bytes: int
    launches: int
    minimum: int

    @property
    def total(self) -> int:
        return self.forward_bytes + self.backward_bytes


def minimum_bytes(rows: int, hidden: int, element: int, rms: bool) -> int:
    """Five passes over the activations, the parameters each direction reads and the
    gradients the backward writes, and the statistics written once and read once."""
    activations = 5 * rows * hidden * element
    params = 1 if rms else 2
    parameters = 3 * params * hidden * element  # read forward, read backward, gradient written
    statistics = 2 * (1 if rms else 2) * rows * STATS_BYTES
    return activations + parameters + statistics


def measure(ops: Any, rms: bool, dtype: torch.dtype, hidden: int, rows: int) -> Row:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    bias = None if rms else torch.randn(hidden, generator=gen).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    emulation.reset_counters()
    _, mean, invvar = ops.norm_forward(x, weight, bias, 1e-5, rms, False, False)
    forward = emulation.counters()
    emulation.reset_counters()
    ops.norm_backward(dy, x, mean, invvar, weight, bias, rms, False, dtype)
    backward = emulation.counters()
    return Row(
        "RMSNorm" if rms else "LayerNorm",
        next(k for k, v in DTYPES.items() if v == dtype),
        hidden,
        rows,
        forward.bytes_read + forward.bytes_written,
        backward.bytes_read + backward.bytes_written,
        forward.launches + backward.launches,
        minimum_bytes(rows, hidden, x.element_size(), rms),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| norm | dtype | hidden | forward B/elem | backward B/elem | total B/elem "
        "| min B/elem | vs min | launches |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        elements = r.rows * r.hidden
        lines.append(
            f"| {r.norm} | {r.dtype} | {r.hidden} | {r.forward_bytes / elements:.2f} | "
            f"{r.backward_bytes / elements:.2f} | {r.total / elements:.2f} | "
            f"{r.minimum / elements:.2f} | {r.total / r.minimum:.2f}x | {r.launches} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="ignored: the emulator runs on the CPU")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu":
        print("bench_norm_bytes: the emulated kernels run on the CPU only; nothing to do")
        return 0
    torch.set_num_threads(1)
    emulation.load("counting")
    ops = torch.ops.amp_fused_ops_emu  # the emulated build's norm ops
    rows = [
        measure(ops, rms, DTYPES[dtype], hidden, args.rows)
        for rms in (False, True)
        for dtype in args.dtypes
        for hidden in args.hidden
    ]
    print(
        f"Global-memory bytes per activation element of one forward + backward ({args.rows} "
        f"rows), counted on the emulated CUDA kernels (an H100's 132 SMs); torch "
        f"{torch.__version__}, amp_fused_ops {amp_fused_ops.__version__}, Python "
        f"{platform.python_version()}, {datetime.date.today()}"
    )
    print(table(rows))
    out = Path(__file__).resolve().parent / "out" / "norm_bytes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps([{**asdict(r), "total": r.total} for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
