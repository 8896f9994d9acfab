"""Pure bfloat16 training with stochastic rounding: fp32 vs bf16 round-to-nearest vs bf16 SR.

Trains the same small MLP on scikit-learn's digits three ways, from the same initial weights and
the same batch order:

* ``fp32``: float32 weights, FusedAdam;
* ``bf16-nearest``: bfloat16 weights, gradients and activations, no float32 master copy;
  FusedAdam rounds every updated weight to the nearest bfloat16;
* ``bf16-stochastic``: the same, with ``FusedAdam(..., bf16_stochastic_round=True)``: every
  updated weight is rounded up or down at random, in proportion to its distance from the two
  neighbours, so an update far below the bfloat16 spacing still moves the weight on average.

The learning rate is small relative to the weights (updates of about 1e-4 on weights of about
0.1, whose bfloat16 spacing is 5e-4 to 1e-3): round-to-nearest throws most updates away and
stalls; stochastic rounding keeps them on average and follows the fp32 curve. Prints the final
loss and test accuracy of each run and the memory its weights and optimizer state hold, and
plots the loss and accuracy curves (``--out``, needs matplotlib).

Usage:
    python examples/bf16_stochastic_rounding/train_pure_bf16.py             # the full run
    python examples/bf16_stochastic_rounding/train_pure_bf16.py --smoke     # seconds
    python examples/bf16_stochastic_rounding/train_pure_bf16.py --out curves.png

Needs scikit-learn (the data set); matplotlib only for the plot.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_optimizers import FusedAdam

LOG = logging.getLogger("train_pure_bf16")

RUNS = ("fp32", "bf16-nearest", "bf16-stochastic")
# (steps, evaluate every): the full run and --smoke.
FULL = (3000, 100)
SMOKE = (150, 50)


@dataclass
class Result:
    """One run: the loss and accuracy curves and the final figures."""

    name: str
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    final_loss: float = 0.0
    final_accuracy: float = 0.0
    weight_bytes: int = 0
    optimizer_bytes: int = 0
    seconds: float = 0.0


def load_digits(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits, scaled to [0, 1], split 80/20 (train, test)."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("this example needs scikit-learn (the digits data set): pip install scikit-learn")
    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, Tensor)
    )


def train(name: str, args: argparse.Namespace, data: tuple[Tensor, ...]) -> Result:
    x_train, y_train, x_test, y_test = data
    steps, every = SMOKE if args.smoke else FULL
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    model = make_model(args.seed).to(dtype)
    optimizer = FusedAdam(
        model.parameters(),
        lr=args.lr,
        bf16_stochastic_round=name == "bf16-stochastic",
        stochastic_round_seed=args.seed,
    )
    batches = torch.Generator().manual_seed(args.seed + 1)
    result = Result(name)
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        index = torch.randint(0, len(x_train), (args.batch_size,), generator=batches)
        logits = model(x_train[index].to(dtype))
        loss = F.cross_entropy(logits.float(), y_train[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recent.append(loss.item())
        if step % every == 0 or step == steps:
            with torch.no_grad():
                test_logits = model(x_test.to(dtype)).float()
            accuracy = 100.0 * (test_logits.argmax(1) == y_test).float().mean().item()
            result.steps.append(step)
            result.train_loss.append(sum(recent) / len(recent))
            result.test_accuracy.append(accuracy)
            recent = []
    result.seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model(x_train.to(dtype)).float()
        result.final_loss = F.cross_entropy(logits, y_train).item()
    result.final_accuracy = result.test_accuracy[-1]
    result.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result.optimizer_bytes = state_bytes(optimizer)
    return result


def report(results: list[Result], steps: int) -> str:
    base = results[0]
    lines = [
        f"{steps} steps, batch of digits; final train loss (whole training set) and test accuracy",
        "",
        f"{'run':<16} {'train loss':>10} {'vs fp32':>9} {'test acc %':>10} {'vs fp32':>9} "
        f"{'weights':>9} {'opt state':>9} {'total':>9} {'time':>6}",
    ]
    for r in results:
        loss_delta = 100.0 * (r.final_loss - base.final_loss) / base.final_loss
        acc_delta = r.final_accuracy - base.final_accuracy
        total = r.weight_bytes + r.optimizer_bytes
        lines.append(
            f"{r.name:<16} {r.final_loss:>10.4f} {loss_delta:>+8.1f}% {r.final_accuracy:>10.2f} "
            f"{acc_delta:>+8.2f}p {r.weight_bytes / 1024:>7.0f}KB "
            f"{r.optimizer_bytes / 1024:>7.0f}KB {total / 1024:>7.0f}KB {r.seconds:>5.1f}s"
        )
    return "\n".join(lines)


def plot(results: list[Result], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        LOG.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax_loss.plot(r.steps, r.train_loss, label=r.name)
        ax_acc.plot(r.steps, r.test_accuracy, label=r.name)
    ax_loss.set(xlabel="step", ylabel="train loss (mean since last point)", yscale="log")
    ax_acc.set(xlabel="step", ylabel="test accuracy (%)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Pure bfloat16 training: round-to-nearest vs stochastic rounding")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    LOG.info("wrote %s", out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a short run (seconds) for CI")
    parser.add_argument("--lr", type=float, default=1e-4, help="FusedAdam learning rate")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the curves to this PNG")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    data = load_digits(args.seed)
    results = [train(name, args, data) for name in RUNS]
    steps = (SMOKE if args.smoke else FULL)[0]
    print(report(results, steps))
    if args.out is not None:
        plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
