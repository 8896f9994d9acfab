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

from digits_hardware import Machine
from digits_plan import accuracy_resolution

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
# The README block that --record rewrites, one per kind of hardware (Machine.kind).
RECORD_BEGIN = "<!-- recorded run {kind}: begin (written by train_digits.py --record) -->"
RECORD_END = "<!-- recorded run {kind}: end -->"
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
    n_test: int  # images in the test split: the accuracy's resolution
    epochs: int
    rounds: list[dict[str, float]]  # per round: level -> seconds per step
    steps: int
    baseline: str
    unresolved: list[tuple[str, str]]  # pairs of levels the timing cannot rank
    load: tuple[float, float] | None  # lowest and highest 1-minute load average sampled
    warnings: list[str]  # the machine changed under the run (digits_plan.load_warnings)
    sizing: str  # how the run's size was chosen
    seconds: float  # wall time of the whole run
    figure: Path
    command: str = ""  # the arguments the run was started with

    def title(self) -> str:
        return (
            f"digits CNN ({self.n_params / 1e6:.1f} M params, batch {self.batch_size}), "
            f"amp O0-O3 in {self.half_dtype} on {self.machine.device}: {self.machine.describe()}"
        )

    def resolution(self) -> float:
        """Accuracy differences (points) within this are ties: see ``accuracy_resolution``."""
        base = next(r for r in self.results if r.level == self.baseline)
        return accuracy_resolution(base.accuracy, self.n_test)

    def tie(self, result: LevelResult) -> bool:
        base = next(r for r in self.results if r.level == self.baseline)
        return abs(result.accuracy - base.accuracy) <= self.resolution() + 1e-9

    def accuracy_note(self) -> str:
        image = 100.0 / self.n_test
        return (
            f"test acc: {self.n_test} test images, one image = {image:.2f} points; a difference "
            f"to {self.baseline} within {self.resolution():.2f} points (the standard error of "
            "an accuracy on this many images, at least one image) is a tie, marked ="
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
        if self.load is None:
            return ""
        low, high = self.load
        return f"load average {low:.1f} to {high:.1f} during the run"


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


def _ms(value: float) -> str:
    """Milliseconds with 4 to 5 significant digits."""
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def format_table(report: Report) -> str:
    """The terminal table: one row per level, with the rules that produced each column."""
    results = report.results
    base = next(r for r in results if r.level == report.baseline)
    lines = [
        report.title(),
        f"{report.machine.verdict()}. {report.machine.expectation()}",
        f"run: {report.epochs} epochs per level, then {len(report.rounds)} timed rounds of "
        f"{report.steps} steps per level (order rotated each round, models warmed up; "
        f"{report.sizing}); {report.seconds:.0f} s in all"
        + (f"; {report.load_note()}" if report.load_note() else ""),
        report.accuracy_note(),
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
        f"{'level':<6}{'test acc %':>11}{'vs O0':>7}{'':<2}{'step ms':>9} {'[IQR]':<20}"
        f"{'vs ' + report.baseline:>6} {'[IQR]':<16}{'':<7}{'held MiB':>9}{'vs':>7}"
        f"{'saved MiB':>10}{'vs':>7}{'peak MiB':>9}{'vs':>7}"
    )
    columns += f"{'cuda peak':>10}{'vs':>7}" if cuda else ""
    columns += f"{'loss scale':>11}{'skipped':>8}"
    lines += [columns, "-" * len(columns)]
    for r in results:
        t = r.timing
        assert t is not None  # filled in by the timed rounds
        iqr = f"[{_ms(t.step_ms.q1)}, {_ms(t.step_ms.q3)}]"
        ratio_iqr = f"[{t.ratio.q1:.2f}, {t.ratio.q3:.2f}]"
        verdict = "" if r.level == report.baseline else t.verdict
        row = (
            f"{r.level:<6}{r.accuracy:>11.2f}{r.accuracy - base.accuracy:>+7.2f}"
            f"{' =' if r is not base and report.tie(r) else '':<2}"
            f"{_ms(t.step_ms.median):>9} {iqr:<20}{t.ratio.median:>6.2f} {ratio_iqr:<16}"
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
    lines += [f"warning: {message}" for message in report.warnings]
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
    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(15, 5.6))

    labels = legend_labels(results)
    for r in results:
        style = {"color": COLORS.get(r.level), **STYLES.get(r.level, {"marker": "o"})}
        epochs = range(1, len(r.epoch_losses) + 1)
        ax_loss.plot(epochs, r.epoch_losses, label=labels[r.level], **style)
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", yscale="log", title="loss")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax_loss.set_xlim(0.5, max(len(r.epoch_losses) for r in results) + 0.5)
    ax_loss.legend(title="level (test accuracy)", fontsize=9)
    for text, r in zip(ax_loss.get_legend().get_texts(), results, strict=True):
        tie = f" (tie with {report.baseline})" if r is not base and report.tie(r) else ""
        text.set_text(f"{text.get_text()}  {r.accuracy:.1f} %{tie}")

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

    fig.suptitle(_wrap(report.title(), 150), fontsize=10, y=0.99)
    fig.text(
        0.5,
        0.885,
        report.machine.verdict(),
        ha="center",
        fontsize=10,
        fontweight="bold",
        color="black" if report.machine.native_half else "#b00000",
    )
    note = f"{report.machine.expectation()} {report.timing_note()}"
    if report.load_note():
        note += f" Machine {report.load_note()}."
    note += "".join(f" Warning: {message}." for message in report.warnings)
    fig.text(0.5, 0.005, _wrap(note, 200), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.13, 1, 0.87))
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


def record_figure(directory: Path, machine: Machine) -> Path:
    """Where ``--record`` writes the figure of a run on ``machine``: one per kind of hardware."""
    return directory / f"demo-{machine.kind}.png"


def record_block(readme: Path, kind: str) -> tuple[re.Pattern[str], str, str]:
    """The README block for runs on ``kind`` hardware: (pattern, first line, last line).

    Raises:
        RuntimeError: the README has no such block (checked before the run starts).
    """
    begin, end = RECORD_BEGIN.format(kind=kind), RECORD_END.format(kind=kind)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(readme.read_text()):
        raise RuntimeError(
            f"{readme} has no block between {begin!r} and {end!r} to rewrite; "
            "add the two lines where the recorded run on this kind of hardware belongs"
        )
    return pattern, begin, end


def record(report: Report, readme: Path) -> None:
    """Rewrite the README's block of recorded numbers for this kind of hardware."""
    pattern, begin, end = record_block(readme, report.machine.kind)
    text = readme.read_text()
    figure = report.figure.resolve().relative_to(readme.parent.resolve()).as_posix()
    env = "".join(f"{setting} " for setting in report.machine.held_to)
    block = "\n".join(
        [
            begin,
            f"![loss, step time and memory per opt level, {report.machine.kind}]({figure})",
            "",
            f"Command: `{env}nox -s demo -- {report.command}`"
            f" (runs `{env}python examples/demo/train_digits.py {report.command}`).",
            "",
            f"Machine: {report.machine.describe()}; {report.half_dtype}; "
            + (f"{report.load_note()}; " if report.load_note() else "")
            + f"{report.seconds:.0f} s for the whole run.",
            "",
            "```text",
            format_table(report),
            "```",
            end,
        ]
    )
    readme.write_text(pattern.sub(lambda _: block, text, count=1))
    LOG.info("recorded run written into %s", readme)
