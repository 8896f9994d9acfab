"""Time one fp32 AdamW step: amp's FusedAdam and multi_tensor_adam vs torch.optim.AdamW.

Variants, each on fresh copies of the same fp32 tensors (grads, params, exp_avg, exp_avg_sq):

- ``ours (C++)`` on CPU / ``ours (CUDA)`` on a GPU: ``amp_fused_ops.amp_C.multi_tensor_adam``
  with ``mode=1`` (AdamW), the compiled kernel of the device (skipped, with the reason, when
  it cannot be loaded, so the reference is never timed under its name);
- ``ours (256 thr)``: on a GPU, the same with the launcher's blocks of 256 threads instead of
  512 (``AMP_FUSED_OPS_MULTI_TENSOR_BLOCK=256``), for an A/B of the two in one process;
- ``ours (apex)``: on a GPU, the same kernel launched as Apex's launcher did (a launch per 320
  chunks or per 36 tensors of four lists, ``AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=apex``) instead of
  one launch per batch of up to 81 tensors, for an A/B of the two layouts in one process;
- ``FusedAdam``: ``amp_optimizers.FusedAdam`` (AdamW mode), the whole ``optimizer.step()`` a
  user calls, over the same op;
- ``torch fused``: ``torch.optim.AdamW(fused=True)``;
- ``torch foreach``: ``torch.optim.AdamW(foreach=True)``;
- ``torch for-loop``: ``torch.optim.AdamW(foreach=False)`` (only up to 10M parameters);
- ``reference``: ``amp_fused_ops.reference.multi_tensor_adam`` (pure PyTorch; CPU only, up
  to 10M parameters: it is the test oracle, not a contender).

The optimizers get the same moments as their state, so every variant does the same work from
the same values. Each round copies the tensors afresh for every variant, warms it up and times
a few steps; the median over all rounds is reported. After the last step every variant has
taken the same number of steps from the same values, so its parameters are compared with
torch fused's (max abs difference, recorded, not asserted).

On CUDA each variant also gets its device time (``device ms``): the step captured in a CUDA
graph and replayed, so the kernels alone, apart from the host's launches (a step that cannot
be captured, such as torch's non-capturable optimizers, says why instead).

Bandwidth: fp32 AdamW reads g, p, m, v (16 bytes per parameter) and writes p, m, v (12 bytes),
so GB/s = 28 bytes x parameters / median time; ``% copy`` divides it by the measured copy
bandwidth of the device (``copy_`` of a large fp32 buffer, bytes read + written).

On CPU a thread-scaling table follows (``--no-scaling`` skips it, ``--scaling-only`` runs only
it): one mixed-size launch, 6 tensors of 1M and 50 of 4097 fp32 elements (a few weights and many
small biases and norms), one Adam step with L2 weight decay timed with 1, 2 and all threads
(``torch.set_num_threads``) for ``ours (C++)`` (``mode=0``), ``FusedAdam(adam_w_mode=False)``
and ``torch fused`` (``torch.optim.Adam(fused=True)``), all interleaved in one process (each
round visits every thread count and variant in turn). Each row gives the time against torch fused at
the same thread count and the speed-up over the same variant on 1 thread. The CPU's AVX-512,
AVX-512 BF16 and AMX flags (``/proc/cpuinfo``) are printed and recorded with it.

Usage:
    python benchmarks/bench_multi_tensor_adam.py --device cpu           # 1M, 10M, 100M, 1B
    python benchmarks/bench_multi_tensor_adam.py --device cuda          # 10M, 100M, 1B
    python benchmarks/bench_multi_tensor_adam.py --device cpu --sizes 10e6 100e6
    python benchmarks/bench_multi_tensor_adam.py --device cpu --scaling-only

Prints a table and writes ``benchmarks/out/multi_tensor_adam_<device>.json``. Sizes that do
not fit in memory are skipped (said in the table). Never asserts a time.
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
from torch import Tensor

import amp_fused_ops
from _common import (
    Step,
    copy_bandwidth,
    default_threads,
    device_name,
    fits,
    graph_time_step,
    sync,
    time_step,
    with_env,
)
from amp_fused_ops import amp_C, extensions, reference
from amp_optimizers import FusedAdam

LOG = logging.getLogger("bench_multi_tensor_adam")

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
DEFAULT_SIZES = {"cpu": (1e6, 10e6, 100e6, 1e9), "cuda": (10e6, 100e6, 1e9)}
SMALL_MAX_PARAMS = 10_000_000  # the for-loop optimizer and the reference stop here
BYTES_PER_PARAM = 28  # fp32 AdamW: reads g, p, m, v (16 B), writes p, m, v (12 B)
# Alive at once: the base tensors and one variant's copies (16 B each), plus allocator slack.
MEMORY_PER_PARAM = 2 * 16 * 1.15
GOAL = {"cpu": 1.0, "cuda": 0.95}  # FusedAdam / torch fused
CHUNK_SIZE = 2048 * 32  # Apex's FusedAdam chunk size
BLOCK = (1024, 1024)  # a weight matrix; each comes with a bias of 1024
# The thread-scaling case: a few big tensors and many small ones in one launch.
MIXED_SHAPES: tuple[tuple[int, ...], ...] = ((1 << 20,),) * 6 + ((4097,),) * 50
SCALING_VARIANTS = ("ours (C++)", "FusedAdam", "torch fused")
SCALING_GOAL = 0.9  # FusedAdam / torch fused at every thread count, and scaling >= torch's
# /proc/cpuinfo flags recorded with the scaling table (the vector units the kernels may use).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
BLOCK_ENV = "AMP_FUSED_OPS_MULTI_TENSOR_BLOCK"  # the launcher's threads per block: 512 or 256
OURS_256 = "ours (256 thr)"
LAYOUT_ENV = "AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT"  # the launcher's launches: batch or apex
OURS_APEX = "ours (apex)"

# Tensors are (grads, params, exp_avgs, exp_avg_sqs), each a list with one entry per shape.
TensorLists = list[list[Tensor]]


@dataclass
class VariantResult:
    variant: str
    median_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: list[float]
    ratio_vs_torch_fused: float = math.nan
    gb_per_s: float = math.nan
    fraction_of_copy_bandwidth: float = math.nan
    max_abs_diff_vs_torch_fused: float = math.nan
    # On CUDA: the device time of a step (CUDA graph replay), or why there is none.
    device_median_ms: float = math.nan
    device_time_skipped: str = ""


@dataclass
class SizeResult:
    requested_params: int
    params: int
    shapes: list[list[int]]
    results: list[VariantResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def parameter_shapes(total: int) -> list[tuple[int, ...]]:
    """Shapes that add up to ``total``: 1024x1024 weights with 1024-element biases, then the rest.

    The rest is one (rows, 1024) matrix and a 1-D tail, so the count is exact.
    """
    rows, cols = BLOCK
    layer = rows * cols + cols
    shapes: list[tuple[int, ...]] = []
    for _ in range(total // layer):
        shapes += [BLOCK, (cols,)]
    rest = total % layer
    if rest >= cols:
        shapes.append((rest // cols, cols))
    if rest % cols:
        shapes.append((rest % cols,))
    return shapes


def make_tensors(shapes: Sequence[tuple[int, ...]], seed: int, device: str) -> TensorLists:
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(shape: tuple[int, ...], scale: float) -> Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale

    grads = [rand(s, 1e-2) for s in shapes]
    params = [rand(s, 1e-1) for s in shapes]
    exp_avgs = [rand(s, 1e-3) for s in shapes]
    # As mid-training: v >= m**2 (a v far below m**2 makes m / sqrt(v) explode, and the
    # variants' rounding differences with it).
    exp_avg_sqs = [
        rand(s, 1e-2).square() + m.square() for s, m in zip(shapes, exp_avgs, strict=True)
    ]
    return [grads, params, exp_avgs, exp_avg_sqs]


def clone_lists(lists: TensorLists) -> TensorLists:
    return [[t.clone() for t in tensors] for tensors in lists]


def multi_tensor_step(op: Callable[..., None], lists: TensorLists, mode: int = 1) -> Step:
    """``op`` over the lists, one step per call; mode 1: AdamW, mode 0: Adam (L2 decay)."""
    noop_flag = torch.zeros(1, dtype=torch.int32, device=lists[0][0].device)
    step_count = 0

    def step() -> None:
        nonlocal step_count
        step_count += 1
        op(CHUNK_SIZE, noop_flag, lists, LR, *BETAS, EPS, step_count, mode, 1, WEIGHT_DECAY)

    return step


def torch_adamw_step(lists: TensorLists, **kwargs: bool) -> Step:
    return torch_adam_step(lists, torch.optim.AdamW, **kwargs)


def torch_adam_step(
    lists: TensorLists, optimizer_class: Callable[..., torch.optim.Optimizer], **kwargs: bool
) -> Step:
    """``optimizer_class`` (torch.optim.Adam or AdamW) over the lists, from the same moments."""
    grads, params, exp_avgs, exp_avg_sqs = lists
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer = optimizer_class(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs
    )
    # Start from the same moments as the other variants (not from zeros). The fused
    # optimizer keeps its step count on the params' device, the others on the CPU.
    step_device = params[0].device if kwargs.get("fused") else torch.device("cpu")
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True):
        step = torch.tensor(0.0, dtype=torch.float32, device=step_device)
        optimizer.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    return optimizer.step


def fused_adam_step(lists: TensorLists, adam_w_mode: bool = True) -> Step:
    """``amp_optimizers.FusedAdam`` (AdamW mode unless told) over the lists, same moments."""
    grads, params, exp_avgs, exp_avg_sqs = lists
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer = FusedAdam(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adam_w_mode=adam_w_mode
    )
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True):
        optimizer.state[p] = {"exp_avg": m, "exp_avg_sq": v}
    return optimizer.step


def summarize(variant: str, times: list[float]) -> VariantResult:
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return VariantResult(
        variant, statistics.median(times), min(times), deciles[0], deciles[-1], times
    )


def ours_label(device: str) -> str:
    return "ours (CUDA)" if device == "cuda" else "ours (C++)"


def kernel_unavailable_reason(device: str) -> str | None:
    """Why ``amp_C.multi_tensor_adam`` would not run a compiled kernel on ``device``, or None."""
    extension = extensions.get_extension(device)  # builds on first use, then cached
    if extension is None:
        return extensions.unavailable_reason(device) or f"{device} extension not loaded"
    if not hasattr(extension, "multi_tensor_adam"):
        return f"the {device} extension has no multi_tensor_adam"
    return None


def run_size(
    total: int, args: argparse.Namespace, kernel_reason: str | None, bandwidth: float
) -> SizeResult:
    shapes = parameter_shapes(total)
    size = SizeResult(total, sum(math.prod(s) for s in shapes), [list(s) for s in shapes])
    too_big = fits(args.device, MEMORY_PER_PARAM * size.params)
    if too_big is not None:
        size.skipped["all variants"] = too_big
        return size
    base = make_tensors(shapes, args.seed, args.device)
    ours = ours_label(args.device)
    small = size.params <= SMALL_MAX_PARAMS

    builders: dict[str, Callable[[TensorLists], Step]] = {}
    # torch fused first: the others compare their final parameters with its.
    builders["torch fused"] = lambda lists: torch_adamw_step(lists, fused=True)
    if kernel_reason is None:
        builders[ours] = lambda lists: multi_tensor_step(amp_C.multi_tensor_adam, lists)
        if args.device == "cuda":  # the launcher's variants: 256-thread blocks, Apex's launches
            builders[OURS_256] = lambda lists: with_env(
                BLOCK_ENV, "256", multi_tensor_step(amp_C.multi_tensor_adam, lists)
            )
            builders[OURS_APEX] = lambda lists: with_env(
                LAYOUT_ENV, "apex", multi_tensor_step(amp_C.multi_tensor_adam, lists)
            )
    else:
        size.skipped[ours] = kernel_reason
    builders["FusedAdam"] = fused_adam_step
    builders["torch foreach"] = lambda lists: torch_adamw_step(lists, foreach=True)
    if small:
        builders["torch for-loop"] = lambda lists: torch_adamw_step(lists, foreach=False)
    else:
        size.skipped["torch for-loop"] = f"more than {SMALL_MAX_PARAMS:,} parameters"
    if small and args.device == "cpu":
        builders["reference"] = lambda lists: multi_tensor_step(reference.multi_tensor_adam, lists)

    times: dict[str, list[float]] = {name: [] for name in builders}
    diffs: dict[str, float] = {}
    for round_index in range(args.rounds):
        fused_params: list[Tensor] = []
        for name, build in builders.items():
            LOG.info(
                "%s params, round %d/%d, %s: %d warm-up + %d timed steps",
                f"{size.params:,}",
                round_index + 1,
                args.rounds,
                name,
                args.warmup,
                args.iters,
            )
            lists = clone_lists(base)
            times[name] += time_step(build(lists), args.device, args.warmup, args.iters)
            params = lists[1]
            if name == "torch fused":
                fused_params = params
            diff = max(
                (p - f).abs().max().item() for p, f in zip(params, fused_params, strict=True)
            )
            diffs[name] = max(diffs.get(name, 0.0), diff)
            del lists, params
        sync(args.device)

    device_times: dict[str, float] = {}
    device_skipped: dict[str, str] = {}
    if args.device == "cuda":  # the kernels alone: the step replayed from a CUDA graph
        for name, build in builders.items():
            lists = clone_lists(base)
            try:
                samples = graph_time_step(build(lists), args.warmup, args.iters)
                device_times[name] = statistics.median(samples)
            except Exception as error:  # a step that cannot be captured: no device time
                device_skipped[name] = f"{type(error).__name__}: {error}".splitlines()[0][:100]
                torch.cuda.synchronize()
            del lists

    order = [
        ours,
        OURS_256,
        OURS_APEX,
        "FusedAdam",
        "torch fused",
        "torch foreach",
        "torch for-loop",
    ]
    order.append("reference")
    size.results = [summarize(name, times[name]) for name in order if name in times]
    for r in size.results:
        r.device_median_ms = device_times.get(r.variant, math.nan)
        r.device_time_skipped = device_skipped.get(r.variant, "")
    fused_ms = statistics.median(times["torch fused"])
    for r in size.results:
        r.ratio_vs_torch_fused = r.median_ms / fused_ms
        r.gb_per_s = BYTES_PER_PARAM * size.params / (r.median_ms * 1e-3) / 1e9
        r.fraction_of_copy_bandwidth = r.gb_per_s / bandwidth
        r.max_abs_diff_vs_torch_fused = diffs[r.variant]
    return size


@dataclass
class ScalingRow:
    threads: int
    variant: str
    median_ms: float
    min_ms: float
    p90_ms: float
    ratio_vs_torch_fused: float  # at the same thread count
    speedup_vs_one_thread: float  # the same variant on 1 thread / this row
    max_abs_diff_vs_torch_fused: float


@dataclass
class ScalingResult:
    params: int
    shapes: list[list[int]]
    thread_counts: list[int]
    cpu_flags: dict[str, bool]
    rows: list[ScalingRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def cpu_flags() -> dict[str, bool]:
    """Which of ``CPU_FLAGS`` the first processor of /proc/cpuinfo lists (empty if unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return {name: name in present for name in CPU_FLAGS}
    return {}


def scaling_thread_counts() -> list[int]:
    """1, 2 and all the cores this process may use (each once, ascending)."""
    return sorted({1, min(2, default_threads()), default_threads()})


def run_scaling(args: argparse.Namespace, kernel_reason: str | None) -> ScalingResult:
    """The mixed-size step at each thread count, every (threads, variant) cell interleaved."""
    shapes = list(MIXED_SHAPES)
    counts = scaling_thread_counts()
    result = ScalingResult(
        sum(math.prod(s) for s in shapes), [list(s) for s in shapes], counts, cpu_flags()
    )
    base = make_tensors(shapes, args.seed, "cpu")
    # Adam with L2 weight decay, as the CPU goal in docs/design.rst names
    # torch.optim.Adam(fused=True); the same math in all three: mode 0 of the kernel,
    # FusedAdam(adam_w_mode=False).
    builders: dict[str, Callable[[TensorLists], Step]] = {
        "torch fused": lambda lists: torch_adam_step(lists, torch.optim.Adam, fused=True)
    }
    if kernel_reason is None:
        builders["ours (C++)"] = lambda lists: multi_tensor_step(
            amp_C.multi_tensor_adam, lists, mode=0
        )
    else:
        result.skipped["ours (C++)"] = kernel_reason
    builders["FusedAdam"] = lambda lists: fused_adam_step(lists, adam_w_mode=False)
    times: dict[tuple[int, str], list[float]] = {}
    diffs: dict[tuple[int, str], float] = {}
    restore = torch.get_num_threads()
    try:
        for round_index in range(args.rounds):
            for threads in counts:
                torch.set_num_threads(threads)
                fused_params: list[Tensor] = []
                for name, build in builders.items():
                    LOG.info(
                        "scaling, round %d/%d, %d threads, %s",
                        round_index + 1,
                        args.rounds,
                        threads,
                        name,
                    )
                    lists = clone_lists(base)
                    key = (threads, name)
                    step_times = time_step(build(lists), "cpu", args.warmup, args.iters)
                    times.setdefault(key, []).extend(step_times)
                    if name == "torch fused":
                        fused_params = lists[1]
                    diff = max(
                        (p - f).abs().max().item()
                        for p, f in zip(lists[1], fused_params, strict=True)
                    )
                    diffs[key] = max(diffs.get(key, 0.0), diff)
    finally:
        torch.set_num_threads(restore)
    for threads in counts:
        fused_ms = statistics.median(times[(threads, "torch fused")])
        for name in SCALING_VARIANTS:
            if (threads, name) not in times:
                continue
            summary = summarize(name, times[(threads, name)])
            one_thread_ms = statistics.median(times[(counts[0], name)])
            result.rows.append(
                ScalingRow(
                    threads,
                    name,
                    summary.median_ms,
                    summary.min_ms,
                    summary.p90_ms,
                    summary.median_ms / fused_ms,
                    one_thread_ms / summary.median_ms,
                    diffs[(threads, name)],
                )
            )
    return result


def format_scaling(result: ScalingResult) -> str:
    big = sum(1 for s in result.shapes if math.prod(s) == 1 << 20)
    small = len(result.shapes) - big
    flags = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in result.cpu_flags.items())
    lines = [
        f"thread scaling: one Adam step (L2 weight decay) on {result.params:,} parameters in "
        f"{big} x 1M + {small} x 4097 fp32 tensors; torch fused is torch.optim.Adam(fused=True)",
        f"CPU flags: {flags or 'unknown'}",
    ]
    columns = f"{'threads':>7}  {'variant':<14}{'median ms':>11}{'min ms':>9}{'p90 ms':>9}"
    columns += f"{'vs fused':>10}{'vs 1 thread':>13}{'max |dp|':>10}"
    lines += [columns, "-" * len(columns)]
    for r in result.rows:
        lines.append(
            f"{r.threads:>7}  {r.variant:<14}{r.median_ms:>11.2f}{r.min_ms:>9.2f}{r.p90_ms:>9.2f}"
            f"{r.ratio_vs_torch_fused:>9.3f}x{r.speedup_vs_one_thread:>12.2f}x"
            f"{r.max_abs_diff_vs_torch_fused:>10.1e}"
        )
    for name, reason in result.skipped.items():
        lines.append(f"{'':>7}  {name:<14}skipped: {reason}")
    by_key = {(r.threads, r.variant): r for r in result.rows}
    ratios = [by_key[(n, "FusedAdam")].ratio_vs_torch_fused for n in result.thread_counts]
    most = result.thread_counts[-1]
    ours_speedup = by_key[(most, "FusedAdam")].speedup_vs_one_thread
    torch_speedup = by_key[(most, "torch fused")].speedup_vs_one_thread
    met = all(r <= SCALING_GOAL for r in ratios) and ours_speedup >= torch_speedup
    lines.append(
        f"goal: FusedAdam <= {SCALING_GOAL:.2f}x torch fused at every thread count "
        f"({', '.join(f'{r:.3f}x' for r in ratios)}) and a 1 -> {most} thread speed-up >= "
        f"torch fused's ({ours_speedup:.2f}x vs {torch_speedup:.2f}x): "
        f"{'met' if met else 'NOT met'}"
    )
    # The fastest steps are the least disturbed by other processes on a shared machine.
    by_min = [
        by_key[(n, "FusedAdam")].min_ms / by_key[(n, "torch fused")].min_ms
        for n in result.thread_counts
    ]
    min_speedup = {
        name: by_key[(1, name)].min_ms / by_key[(most, name)].min_ms
        for name in ("FusedAdam", "torch fused")
    }
    lines.append(
        f"by fastest step: {', '.join(f'{r:.3f}x' for r in by_min)}; 1 -> {most} thread "
        f"speed-up {min_speedup['FusedAdam']:.2f}x vs {min_speedup['torch fused']:.2f}x"
    )
    return "\n".join(lines)


def goal(size: SizeResult, device: str) -> dict[str, float | bool | None]:
    by_name = {r.variant: r for r in size.results}
    ours = by_name.get("FusedAdam")
    if ours is None:
        return {"fused_adam_vs_torch_fused": None, "goal": GOAL[device], "goal_met": None}
    fused = by_name["torch fused"]
    return {
        "fused_adam_vs_torch_fused": ours.ratio_vs_torch_fused,
        "goal": GOAL[device],
        "goal_met": ours.ratio_vs_torch_fused <= GOAL[device],
        # The fastest steps are the least disturbed by other processes on a shared machine.
        "fused_adam_vs_torch_fused_by_min": ours.min_ms / fused.min_ms,
    }


def format_table(size: SizeResult, size_goal: dict[str, float | bool | None]) -> str:
    lines = [f"{size.params:,} parameters in {len(size.shapes)} fp32 tensors"]
    columns = f"{'variant':<16}{'median ms':>11}{'min ms':>9}{'p10 ms':>9}{'p90 ms':>9}"
    columns += f"{'vs fused':>10}{'GB/s':>8}{'% copy':>8}{'max |dp|':>10}"
    lines += [columns, "-" * len(columns)]
    device = any(not math.isnan(r.device_median_ms) or r.device_time_skipped
                 for r in size.results)  # fmt: skip
    if device:
        lines[-2] += f"{'device ms':>11}"
        lines[-1] = "-" * len(lines[-2])
    for r in size.results:
        line = (
            f"{r.variant:<16}{r.median_ms:>11.2f}{r.min_ms:>9.2f}{r.p10_ms:>9.2f}{r.p90_ms:>9.2f}"
            f"{r.ratio_vs_torch_fused:>9.3f}x{r.gb_per_s:>8.1f}"
            f"{100 * r.fraction_of_copy_bandwidth:>7.0f}%{r.max_abs_diff_vs_torch_fused:>10.1e}"
        )
        if device:
            line += (
                f"  device time: {r.device_time_skipped}"
                if r.device_time_skipped
                else f"{r.device_median_ms:>11.2f}"
            )
        lines.append(line)
    for name, reason in size.skipped.items():
        lines.append(f"{name:<16}skipped: {reason}")
    target = f"goal: FusedAdam <= {size_goal['goal']:.2f}x torch fused"
    if size_goal["goal_met"] is None:
        lines.append(f"{target}: not measured")
    else:
        met = "met" if size_goal["goal_met"] else "NOT met"
        lines.append(
            f"{target}: {size_goal['fused_adam_vs_torch_fused']:.3f}x by median ({met}); "
            f"by fastest step: {size_goal['fused_adam_vs_torch_fused_by_min']:.3f}x"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=None,
        help="parameter counts (default: 1e6 10e6 100e6 1e9 on cpu, 10e6 100e6 1e9 on cuda)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="repeats of the variant sequence")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all cores)"
    )
    scaling = parser.add_mutually_exclusive_group()
    scaling.add_argument(
        "--no-scaling", action="store_true", help="skip the CPU thread-scaling table"
    )
    scaling.add_argument(
        "--scaling-only",
        action="store_true",
        help="run only the CPU thread-scaling table (no size tables)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_multi_tensor_adam: CUDA is not available; nothing timed on cuda.")
        return 0
    torch.set_num_threads(args.threads if args.threads is not None else default_threads())
    ours = ours_label(args.device)
    kernel_reason = kernel_unavailable_reason(args.device)
    if kernel_reason is not None:
        LOG.warning("compiled kernel unavailable, %r is skipped: %s", ours, kernel_reason)
    if args.scaling_only and args.device != "cpu":
        print("bench_multi_tensor_adam: --scaling-only is a CPU table; nothing timed.")
        return 0
    requested = args.sizes if args.sizes is not None else DEFAULT_SIZES[args.device]
    if args.scaling_only:
        requested = []
    bandwidth = (
        copy_bandwidth(args.device, int(max(requested)), args.iters) if requested else math.nan
    )
    sizes = [run_size(int(n), args, kernel_reason, bandwidth) for n in requested]
    scaling = None
    if args.device == "cpu" and not args.no_scaling:
        scaling = run_scaling(args, kernel_reason)
    goals = [goal(s, args.device) for s in sizes]
    record = {
        "benchmark": "multi_tensor_adam",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "amp_fused_ops_version": amp_fused_ops.__version__,
        "python_version": platform.python_version(),
        "device": args.device,
        "device_name": device_name(args.device),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "extension": asdict(extensions.extension_status(args.device)),
        "dtype": "float32",
        "hyperparameters": {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": WEIGHT_DECAY,
            "chunk_size": CHUNK_SIZE,
        },
        "bytes_per_param": BYTES_PER_PARAM,
        "copy_bandwidth_gb_per_s": bandwidth,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "sizes": [asdict(s) | {"goals": g} for s, g in zip(sizes, goals, strict=True)],
        "scaling": None if scaling is None else asdict(scaling),
        "load_average": list(os.getloadavg()),
    }
    threads = f", {record['threads']} threads" if args.device == "cpu" else ""
    print(
        f"{record['device_name']} ({args.device}){threads}, torch {torch.__version__}, fp32; "
        f"GB/s counts {BYTES_PER_PARAM} bytes per parameter (reads g, p, m, v: 16 B; writes "
        f"p, m, v: 12 B); copy bandwidth "
        + (f"{bandwidth:.1f} GB/s (read + write)" if requested else "not measured")
    )
    for s, g in zip(sizes, goals, strict=True):
        print()
        print(format_table(s, g))
    if scaling is not None:
        print()
        print(format_scaling(scaling))
    load = ", ".join(f"{x:.2f}" for x in record["load_average"])
    print(f"\nload average at the end (1, 5, 15 min): {load}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"multi_tensor_adam_{args.device}.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
