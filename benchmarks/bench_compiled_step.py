"""A compiled training step with the toolkit's ops against one with PyTorch's own.

A small transformer-style model (pre-LayerNorm MLP blocks with residuals, width 256, batch
8 x 64 tokens) takes forward, a loss, backward and an AdamW step (weight decay 0.01), in four
variants built from the same seed:

* torch eager: ``nn.LayerNorm`` + ``torch.optim.AdamW(fused=True)``;
* ours eager: ``FusedLayerNorm`` + ``FusedAdam``;
* torch compiled and ours compiled: the same with ``torch.compile(model)`` and
  ``torch.compile(optimizer.step)``.

Rounds alternate the variants. Goal (the toolkit's ops are native to the compiler stack): the
compiled step with our ops is no slower than the compiled step with torch's. Every run compiles
afresh (Inductor's caches off): a graph cached by an older version of the toolkit would
otherwise be what is timed.

    python benchmarks/bench_compiled_step.py            # CPU
    python benchmarks/bench_compiled_step.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch import nn

from _common import (
    cpu_flags,
    default_threads,
    device_name,
    format_cpu_flags,
    load_average,
    time_step,
)
from amp_fused_ops import FusedLayerNorm
from amp_optimizers import FusedAdam

logger = logging.getLogger("bench_compiled_step")
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"
WIDTH, BLOCKS, BATCH, TOKENS = 256, 2, 8, 64


class Block(nn.Module):
    def __init__(self, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.norm = norm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(norm: Callable[[int], nn.Module], device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(norm) for _ in range(BLOCKS)], norm(WIDTH)).to(device)


def _variant(ours: bool, compiled: bool, device: torch.device) -> Callable[[], None]:
    model = _model(FusedLayerNorm if ours else nn.LayerNorm, device)
    if ours:
        optimizer: torch.optim.Optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    step = optimizer.step
    if compiled:
        forward = torch.compile(model)
        step = torch.compile(optimizer.step)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(BATCH, TOKENS, WIDTH, generator=gen, device=device)
    target = torch.randn(BATCH, TOKENS, WIDTH, generator=gen, device=device)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(x), target)
        loss.backward()
        step()

    return train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_compiled_step: CUDA is not available; nothing timed on cuda.")
        return
    torch.set_num_threads(args.threads or default_threads())
    inductor_config.force_disable_caches = True  # compile afresh (see above)
    device = torch.device(args.device)
    names = {
        "torch eager": (False, False),
        "ours eager": (True, False),
        "torch compiled": (False, True),
        "ours compiled": (True, True),
    }
    steps = {name: _variant(ours, compiled, device) for name, (ours, compiled) in names.items()}
    for name, step in steps.items():  # compile (and warm up) before any timing
        logger.info("%s: first steps", name)
        for _ in range(2):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds):
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
        for name in order:
            samples[name] += time_step(steps[name], args.device, args.warmup, args.iters)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    header = (
        f"{device_name(args.device)}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if args.device == "cpu":
        header += f", {format_cpu_flags(cpu_flags())}, load {load_average()}"
    print(header)
    print(f"{'variant':16s} {'median ms':>10s} {'min ms':>8s} {'vs torch compiled':>18s}")
    for name, values in samples.items():
        ratio = medians[name] / medians["torch compiled"]
        print(f"{name:16s} {medians[name]:10.2f} {min(values):8.2f} {ratio:17.3f}x")
    ratio = medians["ours compiled"] / medians["torch compiled"]
    verdict = "met" if ratio <= 1.0 else "NOT met"
    print(f"goal: ours compiled <= torch compiled: {ratio:.3f}x ({verdict})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"compiled_step_{args.device}.json"
    out.write_text(json.dumps({"header": header, "samples_ms": samples}, indent=1))


if __name__ == "__main__":
    main()
