"""The digits demo's outputs: the terminal table, the three-panel figure, JSON, the README block."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from digits_measure import Machine

if TYPE_CHECKING:
    from train_digits import LevelResult

LOG = logging.getLogger("train_digits")

MIB = 2**20
# Line style and marker per level, so that curves lying on top of each other stay visible.
STYLES = {
    "O0": {"linestyle": "-", "marker": "o", "markersize": 7, "linewidth": 2.5},
    "O1": {"linestyle": "-", "marker": "s", "markersize": 9, "linewidth": 4.0, "alpha": 0.45},
    "O2": {"linestyle": "--", "marker": "x", "markersize": 8, "linewidth": 1.5},
    "O3": {"linestyle": ":", "marker": "^", "markersize": 7, "linewidth": 2.0},
}
COLORS = {"O0": "#4c72b0", "O1": "#dd8452", "O2": "#55a868", "O3": "#c44e52"}
MEMORY_COLORS = ("#8c8c8c", "#bcbd22", "#17becf", "#9467bd")
# Two curves closer than this everywhere (relative) cannot be told apart on the plot.
COINCIDE_RTOL = 1e-3
# The README block that --record rewrites.
RECORD_BEGIN = "<!-- recorded run: begin (written by train_digits.py --record) -->"
RECORD_END = "<!-- recorded run: end -->"
NOISE_RULE = (
    "a ratio whose interquartile range over the rounds contains 1.0 is marked ~: "
    "the machine's noise is as large as the difference, so the two are not ranked"
)


@dataclass
class Report:
    """Everything one run measured, and how."""

    results: list[LevelResult]
    machine: Machine
    half_dtype: str
    batch_size: int
    n_params: int
    epochs: int
    rounds: list[dict[str, float]]  # per round: level -> seconds per step
    steps: int
    baseline: str
    unresolved: list[tuple[str, str]]  # pairs of levels the timing cannot rank
    load: tuple[float | None, float | None]  # 1-minute load average before and after
    seconds: float  # wall time of the whole run
    figure: Path
    command: str = ""  # the arguments the run was started with

    def title(self) -> str:
        return (
            f"digits CNN ({self.n_params / 1e6:.1f} M params, batch {self.batch_size}), "
            f"amp O0-O3 in {self.half_dtype} on {self.machine.device}: {self.machine.describe()}"
        )

    def timing_note(self) -> str:
        """What the step-time panel can and cannot say about the order of the levels."""
        unresolved_vs_base = [
            r.level
            for r in self.results
            if r.level != self.baseline and r.timing is not None and r.timing.verdict == "~"
        ]
        text = f"{len(self.rounds)} interleaved rounds x {self.steps} steps; bars: IQR. "
        if unresolved_vs_base:
            text += f"Too noisy to rank against {self.baseline}: {', '.join(unresolved_vs_base)}. "
        if self.unresolved:
            pairs = ", ".join(f"{a}/{b}" for a, b in self.unresolved)
            text += f"Not ranked (ratio IQR contains 1): {pairs}."
        else:
            text += "Every pair of levels is ranked (no ratio IQR contains 1)."
        return text

    def load_note(self) -> str:
        before, after = self.load
        if before is None or after is None:
            return ""
        return f"load average {before:.1f} before, {after:.1f} after"


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


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def format_table(report: Report) -> str:
    """The terminal table: one row per level, with the rules that produced each column."""
    results = report.results
    base = next(r for r in results if r.level == report.baseline)
    lines = [
        report.title(),
        f"run: {report.epochs} epochs per level, then {len(report.rounds)} timed rounds of "
        f"{report.steps} steps per level (order rotated each round, models warmed up); "
        f"{report.seconds:.0f} s in all"
        + (f"; {report.load_note()}" if report.load_note() else ""),
        f"step ms: median [IQR] over the rounds; vs {report.baseline}: median [IQR] of the "
        f"per-round ratio; {NOISE_RULE}",
        "held MiB: weights + gradients + optimizer state (amp's fp32 masters included), each "
        "storage counted once, at the step's checkpoint where they are largest; saved MiB: "
        f"what autograd keeps for the backward of one batch of {report.batch_size}, weights "
        "excluded; peak MiB: held + saved where both are alive",
    ]
    cuda = any(r.cuda_peak_bytes is not None for r in results)
    if cuda:
        lines.append("cuda peak MiB: torch.cuda.max_memory_allocated over the timed steps")
    columns = (
        f"{'level':<6}{'test acc %':>11}{'vs O0':>7}{'step ms':>9} {'[IQR]':<18}"
        f"{'vs ' + report.baseline:>6} {'[IQR]':<16}{'':<7}{'held MiB':>9}{'vs':>7}"
        f"{'saved MiB':>10}{'vs':>7}{'peak MiB':>9}{'vs':>7}"
    )
    columns += f"{'cuda peak':>10}{'vs':>7}" if cuda else ""
    columns += f"{'loss scale':>11}{'skipped':>8}"
    lines += [columns, "-" * len(columns)]
    for r in results:
        t = r.timing
        assert t is not None  # filled in by the timed rounds
        iqr = f"[{t.step_ms.q1:.2f}, {t.step_ms.q3:.2f}]"
        ratio_iqr = f"[{t.ratio.q1:.2f}, {t.ratio.q3:.2f}]"
        verdict = "" if r.level == report.baseline else t.verdict
        row = (
            f"{r.level:<6}{r.accuracy:>11.2f}{r.accuracy - base.accuracy:>+7.2f}"
            f"{t.step_ms.median:>9.2f} {iqr:<18}{t.ratio.median:>6.2f} {ratio_iqr:<16}"
            f"{verdict:<7}{r.held.total / MIB:>9.2f}{_ratio(r.held.total, base.held.total):>7}"
            f"{r.saved_bytes / MIB:>10.2f}{_ratio(r.saved_bytes, base.saved_bytes):>7}"
            f"{r.step_peak_bytes / MIB:>9.2f}{_ratio(r.step_peak_bytes, base.step_peak_bytes):>7}"
        )
        if cuda:
            peak, base_peak = r.cuda_peak_bytes or 0, base.cuda_peak_bytes or 0
            row += f"{peak / MIB:>10.1f}{_ratio(peak, base_peak):>7}"
        row += f"{r.loss_scale:>11g}{r.skipped:>8d}"
        lines.append(row)
    lines.append(report.timing_note())
    figure = shown_path(report.figure)
    lines.append(f"figure: {figure} (numbers: {figure.with_suffix('.json')})")
    return "\n".join(lines)


def shown_path(path: Path) -> Path:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = path.resolve()
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def plot(report: Report, out: Path) -> None:
    """Loss curves, step time relative to the baseline, memory relative to the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = report.results
    base = next(r for r in results if r.level == report.baseline)
    levels = [r.level for r in results]
    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.9))

    labels = legend_labels(results)
    for r in results:
        style = {"color": COLORS.get(r.level), **STYLES.get(r.level, {"marker": "o"})}
        epochs = range(1, len(r.epoch_losses) + 1)
        ax_loss.plot(epochs, r.epoch_losses, label=labels[r.level], **style)
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", yscale="log", title="loss")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax_loss.legend(title="level (test accuracy)", fontsize=9)
    for text, r in zip(ax_loss.get_legend().get_texts(), results, strict=True):
        text.set_text(f"{text.get_text()}  {r.accuracy:.1f} %")

    timings = [r.timing for r in results]
    medians = [t.ratio.median for t in timings if t is not None]
    lower = [t.ratio.median - t.ratio.q1 for t in timings if t is not None]
    upper = [t.ratio.q3 - t.ratio.median for t in timings if t is not None]
    bars = ax_time.bar(
        levels,
        medians,
        yerr=[lower, upper],
        capsize=6,
        color=[COLORS.get(level, "grey") for level in levels],
    )
    for bar, r in zip(bars, results, strict=True):
        assert r.timing is not None
        unranked = r.level != report.baseline and r.timing.verdict == "~"
        if unranked:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        ax_time.annotate(
            f"{r.timing.ratio.median:.2f}x{' ~' if unranked else ''}\n"
            f"{r.timing.step_ms.median:.1f} ms",
            (bar.get_x() + bar.get_width() / 2, r.timing.ratio.q3),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax_time.axhline(1.0, color="black", linewidth=0.8)
    ax_time.set(
        ylabel=f"step time / {report.baseline} step time (lower is faster)",
        title=f"training step time vs {report.baseline}",
        ylim=(0, max(t.ratio.q3 for t in timings if t is not None) * 1.3),
    )

    groups: list[tuple[str, list[float]]] = [
        ("weights + grads + optimizer state", [r.held.total for r in results]),
        (f"saved for backward (batch {report.batch_size})", [r.saved_bytes for r in results]),
        ("step peak: the two together", [r.step_peak_bytes for r in results]),
    ]
    if base.cuda_peak_bytes is not None:
        groups.append(("CUDA peak allocated", [r.cuda_peak_bytes or 0 for r in results]))
    width = 0.8 / len(groups)
    for g, (name, values) in enumerate(groups):
        base_value = values[levels.index(report.baseline)] or 1.0
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(levels))]
        bars = ax_mem.bar(
            xs, [v / base_value for v in values], width, label=name, color=MEMORY_COLORS[g]
        )
        for bar, value in zip(bars, values, strict=True):
            ax_mem.annotate(
                f"{value / MIB:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax_mem.axhline(1.0, color="black", linewidth=0.8)
    ax_mem.set_xticks(range(len(levels)), levels)
    ax_mem.set(
        ylabel=f"memory / {report.baseline} memory (labels: MiB)",
        title=f"memory vs {report.baseline}",
    )
    top = max(bar.get_height() for bar in ax_mem.patches)
    ax_mem.set_ylim(0, top * 1.35)
    ax_mem.legend(fontsize=8, loc="upper left")

    fig.suptitle(_wrap(report.title(), 150), fontsize=10)
    note = report.timing_note()
    if report.load_note():
        note += f" Machine {report.load_note()}."
    fig.text(0.5, 0.01, _wrap(note, 190), ha="center", va="bottom", fontsize=8.5)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    LOG.info("figure written to %s", out)


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(shown_path(value))
    return value


def write_json(report: Report, path: Path) -> None:
    """Every number of the run, for scripts and tests."""
    data = _jsonable(report)
    for level in data["results"]:
        level["held"]["total"] = sum(level["held"].values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    LOG.info("numbers written to %s", path)


def record(report: Report, readme: Path) -> None:
    """Rewrite the README's block of recorded numbers with this run's table and machine."""
    text = readme.read_text()
    pattern = re.compile(re.escape(RECORD_BEGIN) + r".*?" + re.escape(RECORD_END), re.DOTALL)
    if not pattern.search(text):
        raise RuntimeError(
            f"{readme} has no block between {RECORD_BEGIN!r} and {RECORD_END!r} to rewrite; "
            "add the two lines where the recorded run belongs"
        )
    figure = report.figure.resolve().relative_to(readme.parent.resolve()).as_posix()
    block = "\n".join(
        [
            RECORD_BEGIN,
            f"![loss, step time and memory per opt level]({figure})",
            "",
            f"Command: `nox -s demo -- {report.command}`"
            f" (runs `python examples/demo/train_digits.py {report.command}`).",
            "",
            f"Machine: {report.machine.describe()}; {report.half_dtype}; "
            + (f"{report.load_note()}; " if report.load_note() else "")
            + f"{report.seconds:.0f} s for the whole run.",
            "",
            "```text",
            format_table(report),
            "```",
            RECORD_END,
        ]
    )
    readme.write_text(pattern.sub(lambda _: block, text, count=1))
    LOG.info("recorded run written into %s", readme)
