"""Global-memory bytes of a fused norm's forward + backward, counted by the CUDA emulator.

No GPU needed: the CUDA kernels of ``csrc/cuda/layer_norm.cu`` run on the CPU through the
emulator's counting build (``amp_fused_ops.emulation``), which counts every byte a kernel
thread reads or writes in global memory. A norm is memory-bound on a GPU, so its time there
is about these bytes over the bandwidth.

For LayerNorm and RMSNorm in float32, bfloat16 and float16 (parameters in the input's dtype)
and every hidden size of a bucket from 512 to 16384, one ``norm_forward`` and one
``norm_backward`` (the input saved, then the output, as ``memory_efficient=True`` saves it;
``--saved`` picks one) of ``--rows`` rows are counted for each set of
kernels (``AMP_FUSED_OPS_NORM_KERNELS``: ``resident``, the default, and ``per_row``; ``--kernels``
also takes ``resident_column`` and ``resident_generic``), against the
minimum: five passes over the activations (the forward reads ``x`` and writes ``y``; the
backward reads ``x`` (or ``y``) and ``dy`` and writes ``dx``), plus the parameters (read by each
direction, their gradients written once) and the per-row statistics (written by the forward,
read by the backward). ``vs min`` above 1 is traffic a kernel could save: a second read of a
row, or partial sums of the parameter gradients written and read again.

The kernels size their grids by the SM count, and some of their traffic is per block (the
parameters, the parameter-gradient partials), so the count depends on the rows per SM. Rows
enough for a real GPU are too many to emulate thread by thread; the emulated device is scaled
down instead (``--multiprocessors``, default 2) with the rows per SM of a real step: 248 rows on
2 SMs are the 124 rows per SM of 16384 rows on an H100's 132.

Usage:
    python benchmarks/bench_norm_bytes.py [--rows 248] [--multiprocessors 2] [--hidden 512 ...]
        [--saved input|output]

Compiles the emulated extension on first use (minutes). Prints a table and writes
``benchmarks/out/norm_bytes.json``. Never asserts anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
VARIANTS = ("resident", "per_row")  # AMP_FUSED_OPS_NORM_KERNELS, counted by default
# Every value of AMP_FUSED_OPS_NORM_KERNELS (--kernels).
KERNEL_SETS = (*VARIANTS, "resident_column", "resident_generic")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATS_BYTES = 4  # mean and invvar are float32


@dataclass
class Row:
    kernels: str
    saved: str
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


def minimum_bytes(
    rows: int, hidden: int, element: int, rms: bool, saves_output: bool = False
) -> int:
    """Five passes over the activations, the parameters each direction reads and the
    gradients the backward writes, and the statistics written once and read once (a backward
    from the output reads the inverse deviation only)."""
    activations = 5 * rows * hidden * element
    params = 1 if rms else 2
    parameters = 3 * params * hidden * element  # read forward, read backward, gradient written
    written = 1 if rms else 2
    read = 1 if saves_output else written
    statistics = (written + read) * rows * STATS_BYTES
    return activations + parameters + statistics


def measure(
    ops: Any, kernels: str, rms: bool, dtype: torch.dtype, hidden: int, rows: int, saved: str
) -> Row:
    os.environ["AMP_FUSED_OPS_NORM_KERNELS"] = kernels
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    bias = None if rms else torch.randn(hidden, generator=gen).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    emulation.reset_counters()
    saves_output = saved == "output"
    y, mean, invvar = ops.norm_forward(x, weight, bias, 1e-5, rms, False, saves_output)
    forward = emulation.counters()
    emulation.reset_counters()
    ops.norm_backward(
        dy, y if saves_output else x, mean, invvar, weight, bias, rms, saves_output, dtype
    )
    backward = emulation.counters()
    return Row(
        kernels,
        saved,
        "RMSNorm" if rms else "LayerNorm",
        next(k for k, v in DTYPES.items() if v == dtype),
        hidden,
        rows,
        forward.bytes_read + forward.bytes_written,
        backward.bytes_read + backward.bytes_written,
        forward.launches + backward.launches,
        minimum_bytes(rows, hidden, x.element_size(), rms, saves_output),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| kernels | saved | norm | dtype | hidden | forward B/elem | backward B/elem "
        "| total B/elem | min B/elem | vs min | launches |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        elements = r.rows * r.hidden
        lines.append(
            f"| {r.kernels} | {r.saved} | {r.norm} | {r.dtype} | {r.hidden} | "
            f"{r.forward_bytes / elements:.2f} | "
            f"{r.backward_bytes / elements:.2f} | {r.total / elements:.2f} | "
            f"{r.minimum / elements:.2f} | {r.total / r.minimum:.2f}x | {r.launches} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="ignored: the emulator runs on the CPU")
    parser.add_argument("--rows", type=int, default=248)
    parser.add_argument(
        "--multiprocessors", type=int, default=2, help="SMs of the emulated device (H100: 132)"
    )
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_SETS, default=list(VARIANTS))
    parser.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument(
        "--saved",
        nargs="+",
        choices=("input", "output"),
        default=["input", "output"],
        help="what the backward recomputes xhat from: output = memory_efficient=True",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu":
        print("bench_norm_bytes: the emulated kernels run on the CPU only; nothing to do")
        return 0
    torch.set_num_threads(1)
    emulation.load("counting")
    ops = torch.ops.amp_fused_ops_emu  # the emulated build's norm ops
    previous = os.environ.get("AMP_FUSED_OPS_NORM_KERNELS")
    try:
        with emulation.multiprocessors(args.multiprocessors):
            rows = [
                measure(ops, kernels, rms, DTYPES[dtype], hidden, args.rows, saved)
                for saved in args.saved
                for kernels in args.kernels
                for rms in (False, True)
                for dtype in args.dtypes
                for hidden in args.hidden
            ]
    finally:
        if previous is None:
            os.environ.pop("AMP_FUSED_OPS_NORM_KERNELS", None)
        else:
            os.environ["AMP_FUSED_OPS_NORM_KERNELS"] = previous
    print(
        f"Global-memory bytes per activation element of one forward + backward ({args.rows} "
        f"rows), counted on the emulated CUDA kernels (an H100 scaled down to "
        f"{args.multiprocessors} SMs: {args.rows / args.multiprocessors:.0f} rows per SM); torch "
        f"{torch.__version__}, amp_fused_ops {amp_fused_ops.__version__}, Python "
        f"{platform.python_version()}, {datetime.date.today()}"
    )
    print(table(rows))
    out = Path(__file__).resolve().parent / "out" / "norm_bytes.json"
    out.parent.mkdir(exist_ok=True)
    records = [
        {**asdict(r), "total": r.total, "multiprocessors": args.multiprocessors} for r in rows
    ]
    out.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
