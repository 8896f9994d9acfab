"""Run the three end-to-end examples at every opt level and print the results table.

Each run is the example script started as a user would (a subprocess); the metrics come from
the lines it prints (``epoch i/n key value ...``, ``test_ppl``). Every example runs at every
opt level with the same seeds (``--seeds``, default 1 2 3); a level's result is the mean over
the seeds. O1, O2 and O3 are compared with O0 under the tolerances stated in
``examples/README.md``: mean accuracy within 1 point, mean perplexity within 2 %. Several seeds
because the spread between seeds at one level (a few percent of perplexity in these short
runs) is larger than the difference between levels at one seed. The table (Markdown) goes to
stdout, every run's full record to ``examples/out/results_<device>.json``.

Usage:
    python examples/collect_results.py                    # CPU, the sizes of the README table
    python examples/collect_results.py --device cuda      # the same runs on a GPU
    python examples/collect_results.py --only lm --levels O0 O2 --seeds 1

Throughput is the median over a run's epochs; on a shared machine it moves with the load,
the quality metrics do not (every run is seeded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
LEVELS = ("O0", "O1", "O2", "O3")


@dataclass(frozen=True)
class Example:
    """One example script, the flags of its table-sized run, and what is reported."""

    key: str
    title: str
    script: str
    flags: tuple[str, ...]
    quality: str  # the metric compared across opt levels
    higher_is_better: bool
    throughput: str  # per-epoch throughput column of the script's lines


# The language model's sizes the table was recorded with (--smoke alone now reads 30 000 tokens
# with a vocabulary of 500, and gives Adam lr 1e-2).
LM_SIZES = ("--max-tokens", "60000", "--vocab-size", "2000", "--lr", "5e-3")
DCGAN_SIZES = ("--ndf", "16")

EXAMPLES_RUN = (
    Example(
        "imagenet",
        "ImageNet-style ResNet (synthetic, 10 classes)",
        "imagenet/main_amp.py",
        ("--smoke", "--epochs", "4", "--train-size", "2048", "--val-size", "512", "--noise", "3.0"),
        "top1",
        True,
        "images/s",
    ),
    Example(
        "lm",
        "Word language model, LSTM (stdlib corpus)",
        "word_language_model/main.py",
        ("--smoke", "--model", "LSTM", "--optimizer", "fused_adam", "--epochs", "4", *LM_SIZES),
        "test_ppl",
        False,
        "tokens/s",
    ),
    Example(
        "lm_transformer",
        "Word language model, Transformer (stdlib corpus)",
        "word_language_model/main.py",
        (
            "--smoke",
            "--model",
            "Transformer",
            "--optimizer",
            "fused_adam",
            "--epochs",
            "4",
            *LM_SIZES,
        ),
        "test_ppl",
        False,
        "tokens/s",
    ),
    Example(
        "dcgan",
        "DCGAN, three losses (digits 32x32)",
        "dcgan/main_amp.py",
        # The sizes the table was recorded with (--smoke alone now takes 512 images, batch 32,
        # 8 discriminator features).
        ("--smoke", "--epochs", "6", "--num-images", "1797", "--batch-size", "64", *DCGAN_SIZES),
        "fd",
        False,
        "images/s",
    ),
)


@dataclass
class Run:
    example: str
    opt_level: str
    seed: int
    command: list[str]
    seconds: float
    quality: float
    throughput: float
    last_epoch: dict[str, float] = field(default_factory=dict)
    within_tolerance: bool | None = None


def _epochs(stdout: str) -> list[dict[str, float]]:
    rows = []
    for match in re.finditer(r"epoch (\d+)/\d+ (.*)$", stdout, flags=re.MULTILINE):
        fields = match.group(2).split()
        rows.append({k: float(v) for k, v in zip(fields[::2], fields[1::2], strict=False)})
    return rows


def run_one(example: Example, level: str, seed: int, device: str, out_dir: Path) -> Run:
    """Run ``example`` at ``level`` with ``seed`` and parse its metrics (raises on failure)."""
    command = [sys.executable, str(EXAMPLES / example.script), *example.flags]
    command += ["--device", device, "--opt-level", level, "--seed", str(seed)]
    if example.key == "dcgan":
        command += ["--outf", str(out_dir / f"dcgan_{level}_seed{seed}")]
    env = dict(os.environ)
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    rows = _epochs(done.stdout)
    if not rows:
        raise RuntimeError(f"no epoch lines in the output of {' '.join(command)}:\n{done.stdout}")
    if example.quality == "test_ppl":
        match = re.search(r"test_ppl ([0-9.]+|inf|nan)", done.stdout)
        if match is None:
            raise RuntimeError(f"no test_ppl in the output of {' '.join(command)}")
        quality = float(match.group(1))
    else:
        quality = rows[-1][example.quality]
    throughput = statistics.median(r[example.throughput] for r in rows)
    return Run(example.key, level, seed, command, seconds, quality, throughput, rows[-1])


@dataclass
class Level:
    """The runs of one example at one opt level (one per seed), summarized."""

    opt_level: str
    runs: list[Run]
    within_tolerance: bool | None = None

    @property
    def quality(self) -> float:
        return statistics.fmean(r.quality for r in self.runs)

    @property
    def spread(self) -> tuple[float, float]:
        return min(r.quality for r in self.runs), max(r.quality for r in self.runs)

    @property
    def throughput(self) -> float:
        return statistics.median(r.throughput for r in self.runs)

    @property
    def seconds(self) -> float:
        return statistics.median(r.seconds for r in self.runs)


def judge(example: Example, levels: list[Level]) -> None:
    """Mark each level as within the README's tolerance of O0 (on the means), or not."""
    base = next((lv for lv in levels if lv.opt_level == "O0"), None)
    if base is None:
        return
    for level in levels:
        if example.quality == "top1":
            level.within_tolerance = level.quality >= base.quality - 1.0
        elif example.quality == "test_ppl":
            level.within_tolerance = (
                math.isfinite(level.quality) and level.quality <= 1.02 * base.quality
            )
        # The GAN's Fréchet distance has no stated tolerance: reported only.


def table(levels_by_example: dict[str, list[Level]]) -> str:
    lines = [
        "| example | opt level | result (mean over seeds) | min - max | vs O0 | throughput "
        "| wall s |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for example in EXAMPLES_RUN:
        levels = levels_by_example.get(example.key, [])
        base = next((lv for lv in levels if lv.opt_level == "O0"), None)
        for level in levels:
            if level is base:
                verdict = "base"
            elif level.within_tolerance is None:
                verdict = "" if base is None else "reported"
            else:
                assert base is not None  # judge() sets within_tolerance only against a base
                relative = (
                    f"{level.quality - base.quality:+.2f} pt"
                    if example.quality == "top1"
                    else f"{100 * (level.quality / base.quality - 1):+.1f} %"
                )
                verdict = f"{relative}, {'within' if level.within_tolerance else 'OUT'}"
            low, high = level.spread
            lines.append(
                f"| {example.title} | {level.opt_level} | {example.quality} {level.quality:.2f} "
                f"| {low:.2f} - {high:.2f} | {verdict} "
                f"| {level.throughput:,.0f} {example.throughput} | {level.seconds:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--only", nargs="+", choices=[e.key for e in EXAMPLES_RUN], default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--out-dir", type=Path, default=EXAMPLES / "out")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    levels_by_example: dict[str, list[Level]] = {}
    for example in EXAMPLES_RUN:
        if args.only and example.key not in args.only:
            continue
        levels = []
        for name in args.levels:
            runs = []
            for seed in args.seeds:
                run = run_one(example, name, seed, args.device, args.out_dir)
                sys.stderr.write(
                    f"{example.key} {name} seed {seed}: {example.quality} {run.quality:.3f}\n"
                )
                runs.append(run)
            levels.append(Level(name, runs))
        judge(example, levels)
        levels_by_example[example.key] = levels

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    header = (
        f"{args.device} ({device_name or platform.machine()}), torch {torch.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}"
    )
    header += f", seeds {' '.join(map(str, args.seeds))}"
    print(header)
    print(table(levels_by_example))
    record = {
        "header": header,
        "levels": {
            k: [
                {
                    "opt_level": lv.opt_level,
                    "mean": lv.quality,
                    "within": lv.within_tolerance,
                    "runs": [asdict(r) for r in lv.runs],
                }
                for lv in v
            ]
            for k, v in levels_by_example.items()
        },
    }
    out = args.out_dir / f"results_{args.device}.json"
    out.write_text(json.dumps(record, indent=2))
    failed = [
        lv for levels in levels_by_example.values() for lv in levels if lv.within_tolerance is False
    ]
    return 1 if any(lv.opt_level in ("O1", "O2") for lv in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
