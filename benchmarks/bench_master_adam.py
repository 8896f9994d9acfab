"""Time the fused master-weight AdamW step against torch's fused AdamW plus a copy.

The mixed-precision step keeps fp32 master weights and moments and a half-precision model.
Variants, each on fresh copies of the same values:

- ``ours fused master``: ``amp_C.multi_tensor_adam_capturable_master`` (AdamW mode): reads the
  half gradients (loss-scaled; ``inv_scale`` on the device), steps the fp32 masters and
  moments and writes the half model params in the same pass. On CUDA this is the CUDA kernel;
  on CPU whatever ``amp_C`` runs there (the C++ kernel if the CPU extension has the op, else
  the pure-PyTorch reference), named as such in the table;
- ``FusedAdam O2 step``: ``amp_optimizers.FusedAdam`` holding the fp32 masters, stepped as amp
  O2 steps it (``amp_fused_master_step``: the same kernel plus the optimizer's bookkeeping and
  the device-side overflow flag);
- ``torch fused + copy``: ``torch.optim.AdamW(fused=True)`` on the fp32 masters (given fp32
  gradients, unscaled), then ``torch._foreach_copy_`` of the masters into the half model;
- ``torch fused``: the same AdamW step alone, without the copy (a lower bound for torch);
- ``torch grad cast + fused + copy``: what an O2 step does with torch alone: the half
  gradients copied (and unscaled) into fp32 master gradients first.

Bytes per parameter of the fused step: reads grad (2), master, exp_avg, exp_avg_sq (12), writes
master, exp_avg, exp_avg_sq (12) and the half param (2): 28 bytes, the floor. The measured
device-to-device copy bandwidth (``copy_`` of a large fp32 buffer; read + write) turns it into
a time: ``floor ms = 28 B x params / copy GB/s``.

Usage:
    python benchmarks/bench_master_adam.py --device cuda                 # 10M, 100M, 1B
    python benchmarks/bench_master_adam.py --device cpu --sizes 1e5 1e6

Prints a table and writes ``benchmarks/out/master_adam_<device>.json``. Sizes that do not fit
in device memory are skipped (said in the table). Never asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import amp_fused_ops
from _common import Step, copy_bandwidth, device_name, fits, sync, time_step
from amp_fused_ops import amp_C, extensions
from amp_optimizers import FusedAdam

LOG = logging.getLogger("bench_master_adam")

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
DEFAULT_SIZES = {"cuda": (10e6, 100e6, 1e9), "cpu": (1e5, 1e6)}
BYTES_PER_PARAM = 28  # grad 2 + master/m/v 12 read; master/m/v 12 + half param 2 written
# Memory per parameter with all tensors of the largest variant alive: fp32 master, grad, m, v
# (16 B) and the half model and half grads (4 B), plus headroom for the allocator.
MEMORY_PER_PARAM = 20 * 1.15
CHUNK_SIZE = 2048 * 32
BLOCK = 4096 * 4096  # tensors of 16M elements (a large layer), then the remainder
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
LOSS_SCALE = 1024.0


@dataclass
class VariantResult:
    variant: str
    median_ms: float
    min_ms: float
    samples_ms: list[float]
    gb_per_s_at_28_bytes: float = math.nan
    vs_ours: float = math.nan
    vs_floor: float = math.nan
    max_abs_diff_master_vs_torch: float = math.nan


@dataclass
class SizeResult:
    requested_params: int
    params: int
    tensors: int
    floor_ms: float = math.nan
    results: list[VariantResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def shapes_for(total: int) -> list[int]:
    """Flat tensor sizes adding up to ``total``: 16M-element blocks, then the rest."""
    sizes = [BLOCK] * (total // BLOCK)
    if total % BLOCK:
        sizes.append(total % BLOCK)
    return sizes


@dataclass
class State:
    """Fp32 masters and moments, half model params and loss-scaled half grads."""

    grads: list[Tensor]
    params: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    masters: list[Tensor]


def make_state(sizes: Sequence[int], half: torch.dtype, device: str, seed: int) -> State:
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(n: int, scale: float) -> Tensor:
        return torch.randn(n, generator=generator, device=device) * scale

    masters = [rand(n, 0.1) for n in sizes]
    exp_avgs = [rand(n, 1e-3) for n in sizes]
    exp_avg_sqs = [
        rand(n, 1e-2).square_() + m.square() for n, m in zip(sizes, exp_avgs, strict=True)
    ]
    grads = [(rand(n, 1e-2) * LOSS_SCALE).to(half) for n in sizes]
    params = [m.to(half) for m in masters]
    return State(grads, params, exp_avgs, exp_avg_sqs, masters)


def clone_state(state: State) -> State:
    return State(*([t.clone() for t in tensors] for tensors in state_lists(state)))


def state_lists(state: State) -> list[list[Tensor]]:
    return [state.grads, state.params, state.exp_avgs, state.exp_avg_sqs, state.masters]


def ours_step(state: State, device: str) -> Step:
    noop_flag = torch.zeros(1, dtype=torch.int32, device=device)
    lr = torch.full((1,), LR, device=device)
    step = torch.zeros(1, dtype=torch.int32, device=device)
    inv_scale = torch.full((1,), 1.0 / LOSS_SCALE, device=device)
    lists = state_lists(state)

    def run() -> None:
        step.add_(1)  # on the device: capturable, no host sync
        amp_C.multi_tensor_adam_capturable_master(
            CHUNK_SIZE, noop_flag, lists, lr, *BETAS, EPS, step, 1, 1, WEIGHT_DECAY, inv_scale
        )

    return run


def fused_adam_o2_step(state: State) -> Step:
    """FusedAdam keeping the masters, stepped through the protocol amp O2 uses."""
    params = [p.requires_grad_() for p in state.params]
    for p, g in zip(params, state.grads, strict=True):
        p.grad = g
    optimizer = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    optimizer.amp_enable_fused_master_weights({})
    for p, master, m, v in zip(
        params, state.masters, state.exp_avgs, state.exp_avg_sqs, strict=True
    ):
        # The state's own tensors, so that the masters are compared after the run.
        optimizer.state[p].update(master_param=master, exp_avg=m, exp_avg_sq=v)
    device = params[0].device
    inv_scale = torch.full((), 1.0 / LOSS_SCALE, device=device)
    found_inf = torch.zeros((), device=device)

    def run() -> None:
        found_inf.zero_()
        optimizer.amp_fused_master_step(inv_scale, found_inf)

    return run


def torch_step(state: State, *, copy: bool, grad_cast: bool) -> Step:
    """AdamW(fused=True) on the fp32 masters; optionally the grad cast before, copy after."""
    master_grads = [g.float().div_(LOSS_SCALE) for g in state.grads]
    for m, g in zip(state.masters, master_grads, strict=True):
        m.grad = g
    optimizer = torch.optim.AdamW(
        state.masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    for p, m, v in zip(state.masters, state.exp_avgs, state.exp_avg_sqs, strict=True):
        step = torch.tensor(0.0, dtype=torch.float32, device=p.device)
        optimizer.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    inv_scale = 1.0 / LOSS_SCALE

    def run() -> None:
        if grad_cast:
            torch._foreach_copy_(master_grads, state.grads)
            torch._foreach_mul_(master_grads, inv_scale)
        optimizer.step()
        if copy:
            torch._foreach_copy_(state.params, state.masters)

    return run


def ours_label(device: str) -> tuple[str, str | None]:
    """The table name of our variant on ``device`` (what really runs), and why not, if so."""
    extension = extensions.get_extension(device)
    if extension is not None and hasattr(extension, "multi_tensor_adam_capturable_master"):
        kind = "CUDA kernel" if device == "cuda" else "C++ kernel"
        return f"ours fused master ({kind})", None
    if device == "cuda":
        return "ours fused master", f"no CUDA kernel: {extensions.unavailable_reason('cuda')}"
    return "ours fused master (reference)", None


def run_size(total: int, args: argparse.Namespace, bandwidth: float) -> SizeResult:
    sizes = shapes_for(total)
    result = SizeResult(total, sum(sizes), len(sizes))
    result.floor_ms = BYTES_PER_PARAM * result.params / (bandwidth * 1e9) * 1e3
    label, reason = ours_label(args.device)
    too_big = fits(args.device, MEMORY_PER_PARAM * result.params) if args.device == "cuda" else None
    if too_big is not None:
        result.skipped["all variants"] = too_big
        return result
    half = torch.bfloat16 if args.half == "bf16" else torch.float16
    base = make_state(sizes, half, args.device, args.seed)
    builders: dict[str, Callable[[State], Step]] = {}
    if reason is None:
        builders[label] = lambda s: ours_step(s, args.device)
    else:
        result.skipped[label] = reason
    builders["FusedAdam O2 step"] = fused_adam_o2_step
    builders["torch fused + copy"] = lambda s: torch_step(s, copy=True, grad_cast=False)
    builders["torch fused"] = lambda s: torch_step(s, copy=False, grad_cast=False)
    builders["torch grad cast + fused + copy"] = lambda s: torch_step(s, copy=True, grad_cast=True)
    times: dict[str, list[float]] = {name: [] for name in builders}
    masters: dict[str, list[Tensor]] = {}
    for round_index in range(args.rounds):
        for name, build in builders.items():
            LOG.info("%s params, round %d/%d, %s", f"{result.params:,}", round_index + 1,
                     args.rounds, name)  # fmt: skip
            state = clone_state(base)
            times[name] += time_step(build(state), args.device, args.warmup, args.iters)
            if round_index == 0:
                # Every variant took warmup + iters steps from the same values: keep masters.
                masters[name] = [m.detach().clone() for m in state.masters]
            del state
        sync(args.device)
    reference = masters.get("torch fused + copy", [])
    for name, samples in times.items():
        median = statistics.median(samples)
        variant = VariantResult(name, median, min(samples), samples)
        variant.gb_per_s_at_28_bytes = BYTES_PER_PARAM * result.params / (median * 1e-3) / 1e9
        variant.vs_floor = median / result.floor_ms
        if masters.get(name) and reference:
            variant.max_abs_diff_master_vs_torch = max(
                (a - b).abs().max().item() for a, b in zip(masters[name], reference, strict=True)
            )
        result.results.append(variant)
    del base, masters, reference
    ours = next((r for r in result.results if r.variant.startswith("ours")), None)
    for variant in result.results:
        if ours is not None:
            variant.vs_ours = variant.median_ms / ours.median_ms
    return result


def format_table(size: SizeResult, bandwidth: float) -> str:
    lines = [
        f"{size.params:,} parameters in {size.tensors} tensors; floor {size.floor_ms:.3f} ms "
        f"({BYTES_PER_PARAM} B/param at the measured copy bandwidth {bandwidth:.0f} GB/s)"
    ]
    columns = f"{'variant':<38}{'median ms':>11}{'min ms':>10}{'GB/s@28B':>10}"
    columns += f"{'x floor':>9}{'x ours':>8}{'max |dmaster|':>15}"
    lines += [columns, "-" * len(columns)]
    for r in size.results:
        lines.append(
            f"{r.variant:<38}{r.median_ms:>11.3f}{r.min_ms:>10.3f}{r.gb_per_s_at_28_bytes:>10.1f}"
            f"{r.vs_floor:>9.2f}{r.vs_ours:>8.2f}{r.max_abs_diff_master_vs_torch:>15.1e}"
        )
    for name, reason in size.skipped.items():
        lines.append(f"{name:<38}skipped: {reason}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=None,
        help="parameter counts (default: 10e6 100e6 1e9 on cuda, 1e5 1e6 on cpu)",
    )  # fmt: skip
    parser.add_argument("--half", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of the variant sequence")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_master_adam: CUDA is not available; nothing timed on cuda.")
        return 0
    sizes = args.sizes if args.sizes is not None else DEFAULT_SIZES[args.device]
    bandwidth = copy_bandwidth(args.device, int(max(sizes)), args.iters)
    results = [run_size(int(n), args, bandwidth) for n in sizes]
    record = {
        "benchmark": "master_adam",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "amp_fused_ops_version": amp_fused_ops.__version__,
        "python_version": platform.python_version(),
        "device": args.device,
        "device_name": device_name(args.device),
        "extension": asdict(extensions.extension_status(args.device)),
        "half_dtype": args.half,
        "hyperparameters": {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": WEIGHT_DECAY,
            "loss_scale": LOSS_SCALE,
            "chunk_size": CHUNK_SIZE,
        },
        "bytes_per_param": BYTES_PER_PARAM,
        "copy_bandwidth_gb_per_s": bandwidth,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "sizes": [asdict(r) for r in results],
    }
    print(
        f"{record['device_name']} ({args.device}), torch {torch.__version__}, {args.half} model "
        f"+ fp32 masters; copy bandwidth {bandwidth:.1f} GB/s (read + write)"
    )
    for r in results:
        print()
        print(format_table(r, bandwidth))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"master_adam_{args.device}.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
