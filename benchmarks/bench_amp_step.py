"""Time one training step of a small transformer under fp32, torch.autocast, amp O1 and amp O2,
and compare amp O1 with torch.autocast on an MLP, interleaved, per thread count and loss scale.

A step is forward, loss, backward, optimizer.step() and zero_grad(). Each round builds every
variant afresh (same seed), warms it up and times a few steps; the median over all rounds is
reported. Order matters: ``amp.initialize(opt_level="O1")`` turns casting on for the calling
thread until the next ``initialize``, so within a round fp32 and plain autocast run first, then
O1, then O2 (whose ``initialize`` switches O1 casting off again, before the next round).

The O1 comparison (``--compare``) times an MLP (512-1024-512 + LayerNorm, batch 256, SGD)
under ``torch.autocast`` and under amp O1 with a dynamic loss scale, a static scale of 1 and a
static 128, at each of ``--compare-threads``. Rounds alternate the order of the two (autocast
first, then O1 first, ...), and amp is closed after each O1 block, so the autocast steps never
run with amp's casting on. Each table records the CPU's bf16 features (AVX512-BF16, AMX).

Usage:
    python benchmarks/bench_amp_step.py --device cpu
    python benchmarks/bench_amp_step.py --device cpu --compare-only --compare-threads 1 2
    python benchmarks/bench_amp_step.py --device cuda --iters 100

Prints tables and writes ``benchmarks/out/amp_step_<device>.json``. Never asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _common import cpu_flags, format_cpu_flags, load_average
from amp_core import amp

LOG = logging.getLogger("bench_amp_step")

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
O1_GOAL = 1.05  # O1 step time / autocast step time (docs/design.rst, "Performance goals")

Step = Callable[[], None]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 2048
    dim: int = 256
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch: int = 4


@dataclass
class VariantResult:
    variant: str
    median_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: list[float]
    ratio_vs_autocast: float = math.nan


class Block(nn.Module):
    """Pre-norm attention + MLP block, attention written out so softmax is a visible op."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)  # (B, H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V)


def make_model_and_optimizer(
    cfg: ModelConfig, device: torch.device, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer(cfg).to(device)
    # The same optimizer constructor in every variant; amp O2 swaps in fp32 master weights.
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def fp32_step(cfg: ModelConfig, device: torch.device, seed: int, batch: Tensor) -> Step:
    model, optimizer = make_model_and_optimizer(cfg, device, seed)

    def step() -> None:
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def autocast_step(
    cfg: ModelConfig, device: torch.device, seed: int, batch: Tensor, half: torch.dtype
) -> Step:
    model, optimizer = make_model_and_optimizer(cfg, device, seed)
    # Loss scaling only matters for fp16; bf16 has fp32's exponent range.
    scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16)

    def step() -> None:
        with torch.autocast(device.type, dtype=half):
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step


def amp_step(
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    batch: Tensor,
    half: torch.dtype,
    opt_level: str,
) -> Step:
    model, optimizer = make_model_and_optimizer(cfg, device, seed)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, verbosity=0, half_dtype=half
    )

    def step() -> None:
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # no arguments: Apex's O2 zero_grad takes none

    return step


def time_step(step: Step, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds per call of ``step`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(variant: str, times: list[float]) -> VariantResult:
    deciles = statistics.quantiles(times, n=10)
    return VariantResult(
        variant, statistics.median(times), min(times), deciles[0], deciles[-1], times
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_variants(
    cfg: ModelConfig, device: torch.device, half: torch.dtype, args: argparse.Namespace
) -> list[VariantResult]:
    generator = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=generator)
    batch = batch.to(device)  # (B, T + 1) tokens
    # Built lazily and in this order: fp32 and autocast before amp O1 switches casting on.
    builders: list[tuple[str, Callable[[], Step]]] = [
        ("fp32", lambda: fp32_step(cfg, device, args.seed, batch)),
        ("autocast", lambda: autocast_step(cfg, device, args.seed, batch, half)),
        ("amp O1", lambda: amp_step(cfg, device, args.seed, batch, half, "O1")),
        ("amp O2", lambda: amp_step(cfg, device, args.seed, batch, half, "O2")),
    ]
    # Rounds repeat the whole sequence with fresh models, so a drift in machine load shows
    # up in every variant instead of biasing whichever ran during it.
    times: dict[str, list[float]] = {name: [] for name, _ in builders}
    for round_index in range(args.rounds):
        for name, build in builders:
            LOG.info(
                "round %d/%d, %s: %d warm-up + %d timed steps",
                round_index + 1,
                args.rounds,
                name,
                args.warmup,
                args.iters,
            )
            times[name] += time_step(build(), device, args.warmup, args.iters)
    results = [summarize(name, samples) for name, samples in times.items()]
    autocast_ms = results[1].median_ms
    for r in results:
        r.ratio_vs_autocast = r.median_ms / autocast_ms
    return results


def goals(results: Sequence[VariantResult]) -> dict[str, float | bool]:
    by_name = {r.variant: r for r in results}
    o1, o2 = by_name["amp O1"], by_name["amp O2"]
    return {
        "o1_vs_autocast": o1.ratio_vs_autocast,
        "o1_goal": O1_GOAL,
        "o1_goal_met": o1.ratio_vs_autocast <= O1_GOAL,
        # The fastest steps are the least disturbed by other processes on a shared machine.
        "o1_vs_autocast_by_min": o1.min_ms / by_name["autocast"].min_ms,
        "o2_vs_o1": o2.median_ms / o1.median_ms,
    }


def format_table(results: Sequence[VariantResult], goal: dict[str, float | bool]) -> str:
    columns = f"{'variant':<10}{'median ms':>11}{'min ms':>9}{'p10 ms':>9}{'p90 ms':>9}"
    columns += f"{'vs autocast':>13}"
    lines = [columns, "-" * len(columns)]
    for r in results:
        lines.append(
            f"{r.variant:<10}{r.median_ms:>11.2f}{r.min_ms:>9.2f}{r.p10_ms:>9.2f}{r.p90_ms:>9.2f}"
            f"{r.ratio_vs_autocast:>12.3f}x"
        )
    met = "met" if goal["o1_goal_met"] else "NOT met"
    lines.append(
        f"goal: amp O1 <= {O1_GOAL:.2f}x autocast (medians): {goal['o1_vs_autocast']:.3f}x "
        f"({met}); by fastest step: {goal['o1_vs_autocast_by_min']:.3f}x"
    )
    lines.append(f"amp O2 vs amp O1: {goal['o2_vs_o1']:.3f}x (reported, no goal)")
    return "\n".join(lines)


@dataclass(frozen=True)
class MlpConfig:
    dim: int = 512
    hidden: int = 1024
    batch: int = 256


# The loss scales of the O1 comparison: amp's default, a static scale of one, a static 128.
COMPARE_SCALES: tuple[str, ...] = ("dynamic", "1.0", "128")


def make_mlp(cfg: MlpConfig, device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(cfg.dim, cfg.hidden),
        nn.GELU(),
        nn.Linear(cfg.hidden, cfg.dim),
        nn.LayerNorm(cfg.dim),
    ).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def mlp_autocast_step(
    cfg: MlpConfig, device: torch.device, seed: int, data: tuple[Tensor, Tensor], half: torch.dtype
) -> Step:
    model, optimizer = make_mlp(cfg, device, seed)
    scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16)
    x, y = data

    def step() -> None:
        with torch.autocast(device.type, dtype=half):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return step


def mlp_o1_step(
    cfg: MlpConfig,
    device: torch.device,
    seed: int,
    data: tuple[Tensor, Tensor],
    half: torch.dtype,
    loss_scale: str,
) -> Step:
    model, optimizer = make_mlp(cfg, device, seed)
    scale: float | str = loss_scale if loss_scale == "dynamic" else float(loss_scale)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", verbosity=0, half_dtype=half, loss_scale=scale
    )
    x, y = data

    def step() -> None:
        loss = F.mse_loss(model(x), y)  # O1 runs mse_loss in fp32
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def compare_o1(
    device: torch.device, half: torch.dtype, threads: int, loss_scale: str, args: argparse.Namespace
) -> dict[str, float]:
    """Interleaved medians of the MLP step under autocast and under amp O1 at ``loss_scale``."""
    torch.set_num_threads(threads)
    cfg = MlpConfig()
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.randn(cfg.batch, cfg.dim, generator=generator).to(device)  # (B, D)
    y = torch.randn(cfg.batch, cfg.dim, generator=generator).to(device)  # (B, D)
    builders: list[tuple[str, Callable[[], Step]]] = [
        ("autocast", lambda: mlp_autocast_step(cfg, device, args.seed, (x, y), half)),
        ("amp O1", lambda: mlp_o1_step(cfg, device, args.seed, (x, y), half, loss_scale)),
    ]
    times: dict[str, list[float]] = {"autocast": [], "amp O1": []}
    for round_index in range(args.compare_rounds):
        order = builders if round_index % 2 == 0 else builders[::-1]
        for name, build in order:
            times[name] += time_step(build(), device, args.compare_warmup, args.compare_iters)
            if name == "amp O1":
                amp.close()  # autocast steps run with amp's casting off
    auto, o1 = times["autocast"], times["amp O1"]
    return {
        "threads": threads,
        "loss_scale": loss_scale,
        "autocast_median_ms": statistics.median(auto),
        "o1_median_ms": statistics.median(o1),
        "autocast_min_ms": min(auto),
        "o1_min_ms": min(o1),
        "ratio": statistics.median(o1) / statistics.median(auto),
        "ratio_by_min": min(o1) / min(auto),
    }


def format_compare_table(rows: Sequence[dict[str, float]]) -> str:
    columns = f"{'loss scale':<12}{'autocast ms':>13}{'amp O1 ms':>11}{'O1/autocast':>13}"
    columns += f"{'by min':>9}"
    lines = [columns, "-" * len(columns)]
    for r in rows:
        met = "" if r["ratio"] <= O1_GOAL else "  (goal not met)"
        lines.append(
            f"{r['loss_scale']!s:<12}{r['autocast_median_ms']:>13.2f}{r['o1_median_ms']:>11.2f}"
            f"{r['ratio']:>12.3f}x{r['ratio_by_min']:>8.3f}x{met}"
        )
    return "\n".join(lines)


def run_compare(
    device: torch.device, half: torch.dtype, args: argparse.Namespace
) -> list[dict[str, Any]]:
    flags = cpu_flags() if device.type == "cpu" else {}
    tables = []
    for threads in args.compare_threads:
        rows = [compare_o1(device, half, threads, scale, args) for scale in COMPARE_SCALES]
        heading = (
            f"amp O1 vs torch.autocast, MLP {asdict(MlpConfig())}, {threads} thread(s), "
            f"{str(half).removeprefix('torch.')}, load average {load_average()}"
        )
        if flags:
            heading += f"\nCPU flags: {format_cpu_flags(flags)}"
        print(heading)
        print(format_compare_table(rows))
        tables.append({"threads": threads, "cpu_flags": flags, "rows": rows})
    return tables


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--half-dtype", choices=("auto", "float16", "bfloat16"), default="auto")
    parser.add_argument("--rounds", type=int, default=5, help="repeats of the variant sequence")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per round (default: 1 CPU, 10 CUDA)"
    )
    parser.add_argument(
        "--iters", type=int, default=None, help="timed steps per round (default: 3 CPU, 20 CUDA)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the interleaved amp O1 vs autocast MLP comparison",
    )
    parser.add_argument(
        "--compare-only", action="store_true", help="run only the O1 vs autocast comparison"
    )
    parser.add_argument("--compare-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--compare-rounds", type=int, default=6)
    # A fresh amp.initialize takes a few steps to settle: warm up longer than the variants.
    parser.add_argument("--compare-warmup", type=int, default=5)
    parser.add_argument("--compare-iters", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    if args.warmup is None:
        args.warmup = 1 if on_cpu else 10
    if args.iters is None:
        args.iters = 3 if on_cpu else 20
    if args.half_dtype == "auto":
        half = torch.float16 if device.type == "cuda" else torch.bfloat16
    else:
        half = getattr(torch, args.half_dtype)
    cfg = ModelConfig()
    compare = run_compare(device, half, args) if args.compare or args.compare_only else []
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.compare_only:
        results, goal = [], {}
    else:
        results = run_variants(cfg, device, half, args)
        goal = goals(results)
    record = {
        "benchmark": "amp_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": device.type,
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "half_dtype": str(half).removeprefix("torch."),
        "model": asdict(cfg),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "results": [asdict(r) for r in results],
        "goals": goal,
        "load_average": load_average(),
        "cpu_flags": cpu_flags() if device.type == "cpu" else {},
        "o1_compare": compare,
    }
    if results:
        print(
            f"{record['device_name']} ({device.type}), {record['threads']} threads, "
            f"torch {torch.__version__}, half dtype {record['half_dtype']}"
        )
        print(format_table(results, goal))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"amp_step_{device.type}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    LOG.info("results written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
