"""Time forward + backward of FusedLayerNorm / FusedRMSNorm against PyTorch's layer_norm / rms_norm.

Variants, on the same (rows, hidden) input, upstream gradient and parameters:

- ``ours``: ``amp_fused_ops.FusedLayerNorm`` / ``FusedRMSNorm`` (the CUDA kernels on a GPU;
  skipped, with the reason, when they cannot be loaded, so the PyTorch path is never timed
  under their name; on CPU the PyTorch path with fp32 accumulation, the norms' CPU path);
- ``ours (memory_efficient)``: the same with ``memory_efficient=True`` (with
  ``--memory-efficient``);
- ``ours (per_row kernels)``: on CUDA, the same module on the earlier per-row kernels
  (``AMP_FUSED_OPS_NORM_KERNELS=per_row`` around each step; ``ours`` runs the default,
  ``resident``, with no switch unless the variable names others), for an A/B of the two sets of
  kernels in one process;
- ``ours (resident_column kernels)``: on CUDA at hidden sizes over 8192, the resident kernels
  with the parameter gradients summed by the column kernel instead of in shared memory
  (``AMP_FUSED_OPS_NORM_KERNELS=resident_column``);
- ``ours (resident_generic kernels)``: on CUDA, for RMSNorm (no bias), the resident kernels
  compiled for a bias with the bias skipped at run time, which the default replaces with
  kernels compiled without the bias's registers and sums
  (``AMP_FUSED_OPS_NORM_KERNELS=resident_generic``);
- ``torch``: ``torch.nn.functional.layer_norm`` / ``rms_norm`` with the same parameters.

Three times per variant on CUDA: the wall time of a step (CUDA events around each call: the
host's launches included, what a small model feels), the device time (the step captured in a
CUDA graph, each replay timed: the kernels alone) and the host time (``time.perf_counter``
around each call onto an idle device, synchronized after it outside the timing: the Python,
the dispatcher and the launches), so a kernel regression and a host regression are told apart.
A variant whose step cannot be captured gets no device time (said in the table).

One step is ``y = norm(x)`` then ``torch.autograd.grad(y, (x, *params), dy)`` (no gradient
accumulation). Each round warms every variant up and times a few steps; the median over all
rounds is reported.

Bandwidth: the least a fused forward + backward can move is 5 x rows x hidden elements (read
x, write y; read dy, read x again, write dx; the parameters and per-row statistics are
negligible), so GB/s = 5 x rows x hidden x element size / median time; ``% copy`` divides it by
the measured copy bandwidth of the device (``copy_`` of a large fp32 buffer, read + write).

Usage:
    python benchmarks/bench_norm.py --device cuda                  # 16384 rows
    python benchmarks/bench_norm.py --device cpu                   # 2048 rows, about a minute
    python benchmarks/bench_norm.py --device cpu --rows 64 --hidden 1024 --dtypes bfloat16

Prints a table and writes ``benchmarks/out/norm_<device>.json``. Cases that do not fit in
memory are skipped (said in the table). Never asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fused_ops
from _common import (
    Step,
    copy_bandwidth,
    default_threads,
    device_name,
    fits,
    graph_time_step,
    host_time_step,
    sync,
    time_step,
    with_env,
)
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, extensions

LOG = logging.getLogger("bench_norm")

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
DEFAULT_ROWS = {"cpu": 2048, "cuda": 16384}
DEFAULT_HIDDEN = (1024, 4096, 8192, 16384)
NORMS = ("layer_norm", "rms_norm")
ELEMENTS_MOVED = 5  # per element of x: read x, write y, read dy, read x, write dx
# Alive at once, per element of x: x, dy, y, dx and the grad path's temporaries (fp32 on the
# PyTorch path), with allocator slack.
MEMORY_ELEMENTS = 12
GOAL = 1.0  # ours / torch, bf16 (docs/design.rst, "Performance goals")
GOAL_BANDWIDTH = 0.8  # of the copy bandwidth, on large rows
KERNELS_ENV = "AMP_FUSED_OPS_NORM_KERNELS"


@dataclass
class VariantResult:
    variant: str
    median_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: list[float]
    ratio_vs_torch: float = math.nan
    gb_per_s: float = math.nan
    fraction_of_copy_bandwidth: float = math.nan
    max_abs_diff_vs_torch: float = math.nan
    # Device time (CUDA graph replay) and why there is none.
    device_median_ms: float = math.nan
    device_ratio_vs_torch: float = math.nan
    device_fraction_of_copy_bandwidth: float = math.nan
    device_time_skipped: str = ""
    # Host time (CUDA): issuing the step onto an idle device, synchronized outside the timing.
    host_median_ms: float = math.nan


@dataclass
class CaseResult:
    norm: str
    dtype: str
    rows: int
    hidden: int
    results: list[VariantResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def make_ours(norm: str, hidden: int, memory_efficient: bool) -> nn.Module:
    cls = FusedLayerNorm if norm == "layer_norm" else FusedRMSNorm
    return cls(hidden, memory_efficient=memory_efficient)


def torch_norm(norm: str, module: nn.Module) -> Callable[[Tensor], Tensor]:
    """PyTorch's functional op over ``module``'s parameters and eps."""
    shape = tuple(module.normalized_shape)  # type: ignore[arg-type]
    weight, bias, eps = module.weight, module.bias, module.eps  # type: ignore[union-attr]
    if norm == "layer_norm":
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)  # type: ignore[arg-type]
    return lambda x: F.rms_norm(x, shape, weight, eps)  # type: ignore[arg-type]


def fwd_bwd_step(
    fn: Callable[[Tensor], Tensor], x: Tensor, dy: Tensor, params: list[Tensor]
) -> Step:
    """One forward and backward; the gradients are returned, not accumulated."""
    inputs = [x, *params]

    def step() -> None:
        y = fn(x)
        torch.autograd.grad(y, inputs, dy)

    return step


def with_norm_kernels(kernels: str, step: Step) -> Step:
    """``step`` on the norm kernels ``kernels`` (``AMP_FUSED_OPS_NORM_KERNELS``)."""
    return with_env(KERNELS_ENV, kernels, step)


def summarize(variant: str, times: list[float]) -> VariantResult:
    deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return VariantResult(
        variant, statistics.median(times), min(times), deciles[0], deciles[-1], times
    )


def kernel_unavailable_reason(device: str) -> str | None:
    """Why the fused norms would not run the CUDA kernels on ``device``, or None."""
    if device != "cuda":
        return None
    if extensions.get_extension("cuda") is None:  # builds the extension on first use
        return extensions.unavailable_reason("cuda") or "the CUDA extension did not load"
    for name in ("norm_forward", "norm_backward"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"amp_fused_ops::{name}", "CUDA"):
            return f"the CUDA extension has no kernel of {name}"
    return None


def run_case(
    norm: str,
    dtype: torch.dtype,
    hidden: int,
    args: argparse.Namespace,
    kernel_reason: str | None,
    bandwidth: float,
) -> CaseResult:
    case = CaseResult(norm, str(dtype).removeprefix("torch."), args.rows, hidden)
    elements = args.rows * hidden
    too_big = fits(args.device, MEMORY_ELEMENTS * 4 * elements)
    if too_big is not None:
        case.skipped["all variants"] = too_big
        return case
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    x = torch.randn(args.rows, hidden, generator=generator, device=args.device).to(dtype)
    dy = torch.randn(args.rows, hidden, generator=generator, device=args.device).to(dtype)
    x.requires_grad_(True)

    modules: dict[str, nn.Module] = {}
    if kernel_reason is None:
        modules["ours"] = make_ours(norm, hidden, memory_efficient=False)
        if args.memory_efficient:
            modules["ours (memory_efficient)"] = make_ours(norm, hidden, memory_efficient=True)
    else:
        case.skipped["ours"] = kernel_reason
    reference = make_ours(norm, hidden, memory_efficient=False)
    with torch.no_grad():  # parameters as after some training, the same for every variant
        for p in reference.parameters():
            p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(args.seed)) + 0.5)
    reference.to(device=args.device, dtype=dtype)
    for module in modules.values():
        module.load_state_dict(reference.state_dict())
        module.to(device=args.device, dtype=dtype)
    steps: dict[str, Step] = {
        name: fwd_bwd_step(module, x, dy, list(module.parameters()))
        for name, module in modules.items()
    }
    if args.device == "cuda" and "ours" in modules:
        ours = steps["ours"]
        # The default kernels are timed as a user runs them, without the switch: setting and
        # restoring the variable costs host time every step (about 3-9 us on a CPU here).
        if os.environ.get(KERNELS_ENV, "") not in ("", "resident"):
            steps["ours"] = with_norm_kernels("resident", ours)
        steps["ours (per_row kernels)"] = with_norm_kernels("per_row", ours)
        modules["ours (per_row kernels)"] = modules["ours"]
        if hidden > 8192:  # rows whose parameter gradients the backward sums in shared memory
            steps["ours (resident_column kernels)"] = with_norm_kernels("resident_column", ours)
            modules["ours (resident_column kernels)"] = modules["ours"]
        if norm == "rms_norm":  # no bias: the default runs the kernels compiled without one
            steps["ours (resident_generic kernels)"] = with_norm_kernels("resident_generic", ours)
            modules["ours (resident_generic kernels)"] = modules["ours"]
    theirs = torch_norm(norm, reference)
    steps["torch"] = fwd_bwd_step(theirs, x, dy, list(reference.parameters()))

    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(args.rounds):
        for name, step in steps.items():
            LOG.info(
                "%s %s %dx%d, round %d/%d, %s: %d warm-up + %d timed steps",
                norm, case.dtype, args.rows, hidden, round_index + 1, args.rounds, name,
                args.warmup, args.iters,
            )  # fmt: skip
            times[name] += time_step(step, args.device, args.warmup, args.iters)
    sync(args.device)
    device_times: dict[str, list[float]] = {}
    device_skipped: dict[str, str] = {}
    if args.device == "cuda":
        for name, step in steps.items():
            try:
                device_times[name] = graph_time_step(step, args.warmup, args.iters)
            except Exception as error:  # a step that cannot be captured: no device time
                device_skipped[name] = f"{type(error).__name__}: {error}".splitlines()[0][:120]
                torch.cuda.synchronize()
        host_times = {
            n: host_time_step(s, "cuda", args.warmup, args.iters) for n, s in steps.items()
        }

    with torch.no_grad():
        expected = theirs(x)
        diffs = {}
        for name, m in modules.items():
            out: list[Tensor] = []
            kernels = name.partition("(")[2].removesuffix(" kernels)") or "resident"
            if kernels not in ("per_row", "resident_column", "resident_generic"):
                kernels = "resident"
            with_norm_kernels(kernels, lambda m=m, out=out: out.append(m(x)))()
            diffs[name] = (out[0] - expected).abs().max().item()
    diffs["torch"] = 0.0
    case.results = [summarize(name, samples) for name, samples in times.items()]
    torch_ms = statistics.median(times["torch"])
    torch_device_ms = statistics.median(device_times.get("torch", [math.nan]))
    moved = ELEMENTS_MOVED * elements * x.element_size()
    for r in case.results:
        r.ratio_vs_torch = r.median_ms / torch_ms
        r.gb_per_s = moved / (r.median_ms * 1e-3) / 1e9
        r.fraction_of_copy_bandwidth = r.gb_per_s / bandwidth
        r.max_abs_diff_vs_torch = diffs[r.variant]
        if r.variant in device_times:
            r.device_median_ms = statistics.median(device_times[r.variant])
            r.device_ratio_vs_torch = r.device_median_ms / torch_device_ms
            r.device_fraction_of_copy_bandwidth = (
                moved / (r.device_median_ms * 1e-3) / 1e9 / bandwidth
            )
        r.device_time_skipped = device_skipped.get(r.variant, "")
        if args.device == "cuda":
            r.host_median_ms = statistics.median(host_times[r.variant])
    return case


def goals(cases: Sequence[CaseResult]) -> dict[str, float | bool | None]:
    """docs/design.rst's goals on the bf16 cases: worst ratio to torch, best bandwidth share."""
    ours = [
        (c, r) for c in cases if c.dtype == "bfloat16" for r in c.results if r.variant == "ours"
    ]
    if not ours:
        return {"worst_bf16_ratio_vs_torch": None, "goal": GOAL, "goal_met": None}
    worst = max(r.ratio_vs_torch for _, r in ours)
    largest = max(c.hidden for c, _ in ours)
    bandwidth = min(r.fraction_of_copy_bandwidth for c, r in ours if c.hidden == largest)
    return {
        "worst_bf16_ratio_vs_torch": worst,
        "goal": GOAL,
        "goal_met": worst <= GOAL,
        "bf16_fraction_of_copy_bandwidth_at_largest_hidden": bandwidth,
        "bandwidth_goal": GOAL_BANDWIDTH,
        "bandwidth_goal_met": bandwidth >= GOAL_BANDWIDTH,
    }


def format_table(cases: Sequence[CaseResult], goal: dict[str, float | bool | None]) -> str:
    columns = f"{'norm':<11}{'dtype':<10}{'rows x hidden':>15}  {'variant':<25}"
    columns += f"{'median ms':>10}{'min ms':>9}{'vs torch':>10}{'GB/s':>9}{'% copy':>8}"
    columns += f"{'max |dy|':>10}"
    device = any(not math.isnan(r.device_median_ms) or r.device_time_skipped
                 for c in cases for r in c.results)  # fmt: skip
    if device:  # the CUDA graph replay's figures
        columns += f"{'device ms':>11}{'vs torch':>10}{'% copy':>8}{'host ms':>9}"
    lines = [columns, "-" * len(columns)]
    for c in cases:
        shape = f"{c.rows}x{c.hidden}"
        for r in c.results:
            line = (
                f"{c.norm:<11}{c.dtype:<10}{shape:>15}  {r.variant:<25}{r.median_ms:>10.3f}"
                f"{r.min_ms:>9.3f}{r.ratio_vs_torch:>9.3f}x{r.gb_per_s:>9.1f}"
                f"{100 * r.fraction_of_copy_bandwidth:>7.0f}%{r.max_abs_diff_vs_torch:>10.1e}"
            )
            if device and r.device_time_skipped:
                line += f"  device time: {r.device_time_skipped}"
            elif device:
                line += (
                    f"{r.device_median_ms:>11.3f}{r.device_ratio_vs_torch:>9.3f}x"
                    f"{100 * r.device_fraction_of_copy_bandwidth:>7.0f}%{r.host_median_ms:>9.3f}"
                )
            lines.append(line)
        for name, reason in c.skipped.items():
            lines.append(f"{c.norm:<11}{c.dtype:<10}{shape:>15}  {name:<25}skipped: {reason}")
    target = f"goal: ours <= {GOAL:.2f}x torch on every bf16 case"
    if goal["goal_met"] is None:
        lines.append(f"{target}: not measured")
    else:
        met = "met" if goal["goal_met"] else "NOT met"
        bw_met = "met" if goal["bandwidth_goal_met"] else "NOT met"
        lines.append(f"{target}: worst {goal['worst_bf16_ratio_vs_torch']:.3f}x ({met})")
        share = goal["bf16_fraction_of_copy_bandwidth_at_largest_hidden"]
        assert isinstance(share, float)
        lines.append(
            f"goal: >= {100 * GOAL_BANDWIDTH:.0f}% of copy bandwidth at the largest hidden size "
            f"(bf16): {100 * share:.0f}% ({bw_met})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--rows", type=int, default=None, help="rows of the input (default: 2048 cpu, 16384 cuda)"
    )
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=list(DEFAULT_HIDDEN), help="row lengths"
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=("bfloat16", "float16", "float32"),
        default=["bfloat16", "float32"],
    )  # fmt: skip
    parser.add_argument("--norms", nargs="+", choices=NORMS, default=list(NORMS))
    parser.add_argument(
        "--memory-efficient", action="store_true", help="also time memory_efficient=True"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default: 1 cpu, 3 cuda")
    parser.add_argument("--warmup", type=int, default=None, help="default: 1 cpu, 10 cuda")
    parser.add_argument("--iters", type=int, default=None, help="default: 3 cpu, 50 cuda")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_norm: CUDA is not available; nothing timed on cuda.")
        return 0
    on_cpu = args.device == "cpu"
    args.rows = args.rows if args.rows is not None else DEFAULT_ROWS[args.device]
    args.rounds = args.rounds if args.rounds is not None else (1 if on_cpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 10)
    args.iters = args.iters if args.iters is not None else (3 if on_cpu else 50)
    torch.set_num_threads(args.threads if args.threads is not None else default_threads())
    kernel_reason = kernel_unavailable_reason(args.device)
    if kernel_reason is not None:
        LOG.warning("CUDA norm kernels unavailable, 'ours' is skipped: %s", kernel_reason)
    bandwidth = copy_bandwidth(args.device, args.rows * max(args.hidden), max(args.iters, 5))
    cases = [
        run_case(norm, getattr(torch, dtype), hidden, args, kernel_reason, bandwidth)
        for norm in args.norms
        for dtype in args.dtypes
        for hidden in args.hidden
    ]
    goal = goals(cases)
    record = {
        "benchmark": "norm",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "amp_fused_ops_version": amp_fused_ops.__version__,
        "python_version": platform.python_version(),
        "device": args.device,
        "device_name": device_name(args.device),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # The norms have no C++ CPU kernel: only the CUDA extension matters to them.
        "extension": asdict(extensions.extension_status("cuda")) if not on_cpu else None,
        "elements_moved_per_input_element": ELEMENTS_MOVED,
        "copy_bandwidth_gb_per_s": bandwidth,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "cases": [asdict(c) for c in cases],
        "goals": goal,
    }
    threads = f", {record['threads']} threads" if on_cpu else ""
    print(
        f"{record['device_name']} ({args.device}){threads}, torch {torch.__version__}; forward + "
        f"backward; GB/s counts {ELEMENTS_MOVED} elements moved per input element; copy "
        f"bandwidth {bandwidth:.1f} GB/s (read + write)"
    )
    print(format_table(cases, goal))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"norm_{args.device}.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
