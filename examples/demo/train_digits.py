"""Train a small CNN on scikit-learn's digits under amp opt levels O0-O3 and compare them.

One fresh model per opt level, all from the same initial weights and the same batch order, so
the only difference between the rows of the final table is the opt level. Runs on CUDA with
float16 when a GPU is present, otherwise on CPU with bfloat16.

Usage:
    python examples/demo/train_digits.py                       # all four levels
    python examples/demo/train_digits.py --levels O0 O2 --epochs 5 --device cpu
    python examples/demo/train_digits.py --smoke                       # 2 epochs, seconds

Needs scikit-learn (the data set) and matplotlib (the plot): `nox -s demo` installs both.

Exits with status 1 when O1 or O2 ends more than 1 accuracy point below O0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_core import amp

LOG = logging.getLogger("train_digits")

LEVELS = ("O0", "O1", "O2", "O3")
# O3 is pure half precision (no fp32 master weights, no fp32 batchnorm): reported, not checked.
CHECKED_LEVELS = ("O1", "O2")
MAX_DROP_POINTS = 1.0
O0_TARGET_ACCURACY = 95.0
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "loss_curves.png"
HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SMOKE_EPOCHS = 2
# Line style and marker per level, so that curves lying on top of each other stay visible.
STYLES = {
    "O0": {"linestyle": "-", "marker": "o", "markersize": 7, "linewidth": 2.5},
    "O1": {"linestyle": "-", "marker": "s", "markersize": 9, "linewidth": 4.0, "alpha": 0.45},
    "O2": {"linestyle": "--", "marker": "x", "markersize": 8, "linewidth": 1.5},
    "O3": {"linestyle": ":", "marker": "^", "markersize": 7, "linewidth": 2.0},
}
# Two curves closer than this everywhere (relative) cannot be told apart on the plot.
COINCIDE_RTOL = 1e-3


@dataclass(frozen=True)
class Split:
    """The fixed train/test split, already on the training device."""

    x_train: Tensor  # (N_train, 1, 8, 8) float32 in [0, 1]
    y_train: Tensor  # (N_train,) int64
    x_test: Tensor  # (N_test, 1, 8, 8)
    y_test: Tensor  # (N_test,)


@dataclass
class LevelResult:
    """What one opt level produced."""

    level: str
    accuracy: float  # percent on the test split
    epoch_seconds: float  # median wall time of one epoch
    peak_mib: float  # see MemoryMeter for what is measured
    loss_scale: float
    skipped: int
    epoch_losses: list[float] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="epochs per level (default 12)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_EPOCHS} epochs per level, accuracy reported but not checked (seconds)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG of the loss curves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--loss-scale",
        type=loss_scale_arg,
        default=None,
        help='"dynamic" or a number; default: amp\'s per-level default (dynamic at O1/O2)',
    )
    parser.add_argument(
        "--half-dtype",
        choices=("auto", *HALF_DTYPES),
        default="auto",
        help="low precision type; auto = float16 on CUDA, bfloat16 on CPU",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (the demo targets 2 cores)"
    )
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = SMOKE_EPOCHS if args.smoke else 12
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    return torch.device(name)


def pick_half_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return HALF_DTYPES[name]


def load_split(seed: int, device: torch.device) -> Split:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise SystemExit(
            f"the demo loads scikit-learn's digits data set, but scikit-learn is missing ({exc}); "
            "install it with `pip install scikit-learn matplotlib`, or run `nox -s demo`"
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    return Split(x_train.to(device), y_train.to(device), x_test.to(device), y_test.to(device))


def make_model() -> nn.Module:
    # BatchNorm layers are what O2 keeps in fp32 (keep_batchnorm_fp32) and O3 does not.
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False),  # (B, 8, 8, 8)
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),  # (B, 16, 8, 8)
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),  # (B, 16, 4, 4)
        nn.Flatten(),  # (B, 256)
        nn.Linear(256, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class MemoryMeter:
    """Peak memory of one opt level, in MiB.

    CUDA: ``torch.cuda.max_memory_allocated`` after a peak reset (tensor memory only).
    CPU: peak resident set size above the RSS at the start of the level, sampled from
    ``/proc/self/statm`` every 2 ms by a background thread; ``ru_maxrss`` cannot be used per
    level because it only ever grows over the life of the process. Without ``/proc`` the
    growth of ``ru_maxrss`` is reported instead (0 once an earlier level set the peak).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._peak_bytes = 0

    @staticmethod
    def description(device: torch.device) -> str:
        if device.type == "cuda":
            return "peak MiB = torch.cuda.max_memory_allocated"
        if Path("/proc/self/statm").exists():
            return "peak MiB = peak RSS above level start (sampled every 2 ms)"
        return "peak MiB = growth of ru_maxrss"

    @contextmanager
    def measure(self) -> Iterator[MemoryMeter]:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif Path("/proc/self/statm").exists():
            base = _rss_bytes()
            self._peak_bytes = base
            sampler = threading.Thread(target=self._sample, daemon=True)
            sampler.start()
            try:
                yield self
            finally:
                self._stop.set()
                sampler.join()
            self.peak_mib = max(self._peak_bytes, _rss_bytes()) / 2**20 - base / 2**20
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            yield self
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
            # ru_maxrss is in KiB on Linux, bytes on macOS.
            self.peak_mib = growth / (2**20 if sys.platform == "darwin" else 2**10)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak_bytes = max(self._peak_bytes, _rss_bytes())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def loss_scale_arg(value: str) -> str | float:
    """argparse type of ``--loss-scale``: ``"dynamic"`` or a positive number."""
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except ValueError:
        scale = -1.0
    if not 0.0 < scale < float("inf"):
        raise argparse.ArgumentTypeError(
            f'must be "dynamic" or a positive number, got {value!r}; e.g. --loss-scale 128'
        )
    return scale


def warm_up(split: Split, batch_size: int, half_dtype: torch.dtype) -> None:
    """Untimed training steps in fp32 and in the half dtype, without amp.

    Library start-up costs (thread pools, kernel caches, allocator arenas) land here instead of
    in the time and memory of whichever level happens to run first.
    """
    x, y = split.x_train[:batch_size], split.y_train[:batch_size]
    for dtype in (torch.float32, half_dtype):
        model = make_model().to(x.device, dtype)
        optimizer = torch.optim.Adam(model.parameters())
        for _ in range(2):
            F.cross_entropy(model(x.to(dtype)).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        test_accuracy(model, Split(x, y, split.x_test.to(dtype), split.y_test))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    split: Split,
    batch_size: int,
    generator: torch.Generator,
) -> float:
    """One pass over the training split; returns the mean training loss."""
    model.train()
    order = torch.randperm(len(split.y_train), generator=generator).to(split.y_train.device)
    total = torch.zeros((), device=split.y_train.device)
    batches = order.split(batch_size)
    for index in batches:
        logits = model(split.x_train[index])  # (B, 10); amp returns fp32 under O2/O3
        loss = F.cross_entropy(logits.float(), split.y_train[index])
        optimizer.zero_grad()  # no set_to_none: Apex's O2 zero_grad takes no arguments
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()  # amp skips it when the gradients overflowed
        total += loss.detach()
    return total.item() / len(batches)


@torch.no_grad()
def test_accuracy(model: nn.Module, split: Split) -> float:
    model.eval()
    predicted = model(split.x_test).argmax(dim=1)
    return (predicted == split.y_test).float().mean().item() * 100.0


def run_level(
    level: str,
    split: Split,
    args: argparse.Namespace,
    device: torch.device,
    half_dtype: torch.dtype,
) -> LevelResult:
    meter = MemoryMeter(device)
    epoch_times: list[float] = []
    losses: list[float] = []
    with meter.measure():
        torch.manual_seed(args.seed)  # same initial weights for every level
        model = make_model().to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        model, optimizer = amp.initialize(
            model,
            optimizer,
            opt_level=level,
            loss_scale=args.loss_scale,
            verbosity=0,
            half_dtype=half_dtype,
        )
        generator = torch.Generator().manual_seed(args.seed)  # same batch order too
        for epoch in range(args.epochs):
            start = time.perf_counter()
            losses.append(train_epoch(model, optimizer, split, args.batch_size, generator))
            sync(device)
            epoch_times.append(time.perf_counter() - start)
            LOG.info("%s epoch %d/%d loss %.4f", level, epoch + 1, args.epochs, losses[-1])
        accuracy = test_accuracy(model, split)
    scaler_state = amp.state_dict()["loss_scaler0"]
    return LevelResult(
        level=level,
        accuracy=accuracy,
        epoch_seconds=sorted(epoch_times)[len(epoch_times) // 2],
        peak_mib=meter.peak_mib,
        loss_scale=float(scaler_state["loss_scale"]),
        skipped=amp.skipped_steps(optimizer),
        epoch_losses=losses,
    )


def accuracy_failures(results: Sequence[LevelResult]) -> list[str]:
    """Messages for every checked level that ends too far below O0 (empty when all pass)."""
    baseline = next((r for r in results if r.level == "O0"), None)
    if baseline is None:
        return []
    return [
        f"{r.level} test accuracy {r.accuracy:.2f}% is {baseline.accuracy - r.accuracy:.2f} "
        f"points below O0 ({baseline.accuracy:.2f}%); allowed: {MAX_DROP_POINTS}"
        for r in results
        if r.level in CHECKED_LEVELS and baseline.accuracy - r.accuracy > MAX_DROP_POINTS
    ]


def format_table(
    results: Sequence[LevelResult], device: torch.device, half_dtype: torch.dtype
) -> str:
    baseline = next((r.accuracy for r in results if r.level == "O0"), None)
    header = (
        f"device {device.type}, half dtype {_dtype_name(half_dtype)}, "
        f"torch {torch.__version__}; s/epoch = median epoch wall time; "
        f"{MemoryMeter.description(device)}"
    )
    columns = f"{'level':<6}{'test acc %':>11}{'vs O0':>8}{'s/epoch':>9}"
    columns += f"{'peak MiB':>10}{'loss scale':>12}{'skipped':>9}"
    lines = [header, columns, "-" * len(columns)]
    for r in results:
        delta = "" if baseline is None else f"{r.accuracy - baseline:+.2f}"
        lines.append(
            f"{r.level:<6}{r.accuracy:>11.2f}{delta:>8}{r.epoch_seconds:>9.3f}"
            f"{r.peak_mib:>10.1f}{r.loss_scale:>12g}{r.skipped:>9d}"
        )
    return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def coinciding(a: Sequence[float], b: Sequence[float], rtol: float = COINCIDE_RTOL) -> bool:
    """Whether two loss curves are the same on a plot: equal length, every point within rtol."""
    if len(a) != len(b):
        return False
    return all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def legend_labels(results: Sequence[LevelResult]) -> dict[str, str]:
    """Legend text per level; a level whose curve lies on another's says so."""
    labels = {}
    for r in results:
        same = [
            other.level
            for other in results
            if other is not r and coinciding(r.epoch_losses, other.epoch_losses)
        ]
        labels[r.level] = f"{r.level} (same curve as {', '.join(same)})" if same else r.level
    return labels


def plot_losses(
    results: Sequence[LevelResult], out: Path, device: torch.device, half_dtype: torch.dtype
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = legend_labels(results)
    for r in results:
        style = STYLES.get(r.level, {"marker": "o"})
        epochs = range(1, len(r.epoch_losses) + 1)
        ax.plot(epochs, r.epoch_losses, label=labels[r.level], **style)  # type: ignore[arg-type]
    ax.set(
        xlabel="epoch",
        ylabel="mean training loss",
        yscale="log",
        title=f"digits CNN, amp opt levels ({device.type}, {_dtype_name(half_dtype)})",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    LOG.info("loss curves written to %s", out)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    device = pick_device(args.device)
    half_dtype = pick_half_dtype(args.half_dtype, device)
    torch.set_num_threads(args.threads)
    split = load_split(args.seed, device)
    LOG.info(
        "digits: %d train / %d test images; device %s, half dtype %s, %d threads",
        len(split.y_train),
        len(split.y_test),
        device,
        half_dtype,
        torch.get_num_threads(),
    )
    warm_up(split, args.batch_size, half_dtype)
    results = [run_level(level, split, args, device, half_dtype) for level in args.levels]
    print(format_table(results, device, half_dtype))
    plot_losses(results, args.out, device, half_dtype)
    o0 = next((r for r in results if r.level == "O0"), None)
    if o0 is not None and o0.accuracy < O0_TARGET_ACCURACY:
        LOG.warning("O0 reached %.2f%%, below the %.0f%% target", o0.accuracy, O0_TARGET_ACCURACY)
    if args.smoke:
        LOG.info("--smoke: %d epochs per level, accuracy not checked", args.epochs)
        return 0
    failures = accuracy_failures(results)
    for message in failures:
        LOG.error(message)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
