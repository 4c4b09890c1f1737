"""End-of-run report: `WORKDIR/report.md` with PNG plots of the metrics in metrics.jsonl."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dpojax.train.metrics_io import RESERVED_KEYS, read_metrics
from dpojax.train.timing import report_lines as timing_lines

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
# Metrics listed first in the final-metrics table, in this order; others follow alphabetically.
METRIC_ORDER = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
)
_SPLIT_ORDER = ("train", "eval")
_LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: `metrics` (key, legend label) drawn for every split that has them."""

    name: str
    title: str
    ylabel: str
    metrics: tuple[tuple[str, str], ...]
    ylim: tuple[float, float] | None = None
    zero_line: bool = False


PLOTS = (
    PlotSpec("loss", "Loss", "loss", (("loss", "loss"),)),
    PlotSpec(
        "accuracy",
        "Reward accuracy (chosen reward > rejected reward)",
        "accuracy",
        (("rewards/accuracies", "accuracy"),),
        ylim=(-0.03, 1.03),
    ),
    PlotSpec(
        "margins",
        "Reward margin (chosen - rejected)",
        "margin",
        (("rewards/margins", "margin"),),
        zero_line=True,
    ),
    PlotSpec(
        "rewards",
        "Implicit rewards",
        "reward",
        (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected")),
        zero_line=True,
    ),
    PlotSpec(
        "logps",
        "Policy log-probabilities",
        "mean sequence log-prob",
        (("logps/chosen", "chosen"), ("logps/rejected", "rejected")),
    ),
    PlotSpec(
        "learning_rate", "Learning rate", "learning rate", (("learning_rate", "learning rate"),)
    ),
    PlotSpec("grad_norm", "Gradient norm", "global grad norm", (("grad_norm", "grad norm"),)),
    PlotSpec("tokens_per_s", "Throughput", "tokens / s", (("tokens_per_s", "tokens/s"),)),
)


def _splits(records: Sequence[Mapping[str, Any]]) -> list[str]:
    present = {r.get("split", "train") for r in records}
    return [s for s in _SPLIT_ORDER if s in present] + sorted(present - set(_SPLIT_ORDER))


def _as_float(value: Any) -> float | None:
    """A plottable float (inf becomes NaN), or None for a value that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else math.nan


def series(
    records: Sequence[Mapping[str, Any]], split: str, key: str
) -> tuple[list[int], list[float]]:
    """Steps and values of `key` in `split`, sorted by step; non-finite values are NaN."""
    points = []
    for record in records:
        if record.get("split", "train") == split and key in record:
            value = _as_float(record[key])
            if value is not None:
                points.append((record["step"], value))
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def plot_metrics(records: Sequence[Mapping[str, Any]], plots_dir: Path) -> list[tuple[str, Path]]:
    """Draw every plot of PLOTS that has data; returns (title, path) of the PNGs written."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    splits = _splits(records)
    for spec in PLOTS:
        lines = []
        for m_index, (key, label) in enumerate(spec.metrics):
            for s_index, split in enumerate(splits):
                steps, values = series(records, split, key)
                if any(not math.isnan(v) for v in values):
                    lines.append((m_index, s_index, f"{split} {label}", steps, values))
        path = plots_dir / f"{spec.name}.png"
        if not lines:
            path.unlink(missing_ok=True)  # a stale plot of an earlier report
            continue
        _draw(spec, lines, len(spec.metrics) > 1, path)
        written.append((spec.title, path))
    return written


def _draw(spec: PlotSpec, lines: list, color_by_metric: bool, path: Path) -> None:
    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    first = ("tab:green", "tab:red") if color_by_metric else ("tab:blue", "tab:orange")
    palette = (*first, "tab:purple", "tab:brown", "tab:gray")
    for m_index, s_index, label, steps, values in lines:
        color = palette[(m_index if color_by_metric else s_index) % len(palette)]
        ax.plot(
            steps,
            values,
            label=label,
            color=color,
            linestyle=_LINESTYLES[s_index % len(_LINESTYLES)] if color_by_metric else "-",
            marker="o" if len(steps) <= 40 or s_index > 0 else None,
            markersize=3.5,
            linewidth=1.5,
        )
    if spec.zero_line:
        ax.axhline(0.0, color="0.5", linewidth=0.8, zorder=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    all_steps = {step for line in lines for step in line[3]}
    if len(all_steps) == 1:
        (only,) = all_steps
        ax.set_xlim(only - 1, only + 1)
    if spec.ylim is not None:
        ax.set_ylim(*spec.ylim)
    ax.set_title(spec.title)
    ax.set_xlabel("step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=110)


def final_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, dict[str, Any]]]:
    """Per split: (last step, {metric: last value written for it})."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["step"]):
        split = record.get("split", "train")
        _, values = out.get(split, (0, {}))
        values.update({k: v for k, v in record.items() if k not in RESERVED_KEYS})
        out[split] = (record["step"], values)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        text = f"{float(value):.6g}"  # floats, numpy floats
    elif isinstance(value, Mapping | list | tuple):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _metric_sort_key(name: str) -> tuple[int, str]:
    return (METRIC_ORDER.index(name), "") if name in METRIC_ORDER else (len(METRIC_ORDER), name)


def _metrics_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    finals = final_metrics(records)
    splits = _splits(records)
    names = sorted({k for _, values in finals.values() for k in values}, key=_metric_sort_key)
    header = " | ".join(f"{s} (step {finals[s][0]})" for s in splits)
    lines = [f"| metric | {header} |", "|---" * (len(splits) + 1) + "|"]
    for name in names:
        cells = [_fmt(finals[s][1][name]) if name in finals[s][1] else "-" for s in splits]
        lines.append(f"| {_fmt(name)} | " + " | ".join(cells) + " |")
    return lines


def _fence(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return fence


def write_report(
    workdir: str | os.PathLike[str],
    *,
    title: str,
    summary: Mapping[str, Any] | None = None,
    config_text: str | None = None,
    enabled: bool = True,
    plots: bool = True,
) -> Path:
    """Write `WORKDIR/report.md` and `WORKDIR/plots/*.png` from metrics.jsonl; returns the
    report's path. `enabled=False` (processes other than 0) writes nothing; `plots=False` leaves
    out the plots (drawing them takes about 2 s on a small CPU)."""
    workdir = Path(workdir)
    path = workdir / REPORT_FILE
    if not enabled:
        return path
    records = read_metrics(workdir)
    out = [f"# {title}", ""]
    if summary:
        out += ["## Summary", "", "| key | value |", "|---|---|"]
        out += [f"| {_fmt(k)} | {_fmt(v)} |" for k, v in summary.items() if k != "timing"]
        out.append("")
    if summary and summary.get("timing"):
        out += timing_lines(summary["timing"])
    out += ["## Final metrics", ""]
    if records:
        steps = [r["step"] for r in records]
        out.append(f"{len(records)} records from steps {min(steps)} to {max(steps)}.")
        out += ["", *_metrics_table(records), ""]
    else:
        out += ["No metrics were recorded.", ""]
    drawn = plot_metrics(records, workdir / PLOTS_DIR) if plots else []
    if drawn:
        out += ["## Plots", ""]
        for plot_title, plot_path in drawn:
            out += [f"![{plot_title}]({plot_path.relative_to(workdir).as_posix()})", ""]
    if config_text:
        fence = _fence(config_text)
        out += ["## Config", "", fence + "text", config_text.rstrip("\n"), fence, ""]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(out))
    os.replace(tmp, path)
    return path


def _rounds_plot(rounds: Sequence[Mapping[str, Any]], metrics: Sequence[str], path: Path) -> None:
    """Each metric per round: rates (values in [0, 1]) on the left axis, counts on the right."""
    fig = Figure(figsize=(6.0, 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    counts, lines = None, []
    for name in metrics:
        values = [r.get(name) for r in rounds]
        if all(v is None for v in values):
            continue
        rate = all(v is None or 0 <= v <= 1 for v in values)
        if not rate and counts is None:
            counts = ax.twinx()
            counts.set_ylabel("count")
        target = ax if rate else counts
        lines += target.plot(
            [r["round"] for r in rounds], values, marker="o" if rate else "x", label=name
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("rate")
    ax.set_title("Policy quality per round")
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(lines, [line.get_label() for line in lines], fontsize="small")
    fig.savefig(path, dpi=110)


def distinct_decimals(values: Sequence[Any], least: int = 3, most: int = 8) -> int:
    """The fewest decimals (from `least` to `most`) at which the distinct numbers of `values`
    stay distinct, so that a table shows the difference that ranked two rounds."""
    numbers_ = sorted({float(v) for v in values if isinstance(v, numbers.Real) and v == v})
    for decimals in range(least, most + 1):
        shown = {f"{v:.{decimals}f}" for v in numbers_}
        if len(shown) == len(numbers_):
            return decimals
    return most


def _cell(value: Any, decimals: int) -> str:
    return f"{value:.{decimals}f}" if isinstance(value, numbers.Real) else "-"


def write_rounds_report(
    workdir: str | os.PathLike[str],
    out: Mapping[str, Any],
    metrics: Sequence[str],
    plotted: Sequence[str],
) -> Path:
    """`WORKDIR/report.md` of a loop run (`out` is its summary): the initial and final values of
    `metrics`, a plot of `plotted` per round and a table of every round."""
    workdir = Path(workdir)
    plots = workdir / PLOTS_DIR
    plots.mkdir(exist_ok=True)
    rounds = out["rounds"]
    _rounds_plot(rounds, plotted, plots / "quality_per_round.png")
    shown = [k for k in metrics if k in out["initial"]]
    columns = [*shown, "train_loss"]
    # Per column, as many decimals as tell its rounds apart (a tie-break of 0.00044 shows).
    decimals = {
        k: distinct_decimals([r.get(k) for r in rounds] + [out["initial"].get(k)], least=4)
        for k in columns
    }
    lines = ["# dpojax iterative DPO run", "", "| metric | initial | final |", "|---|---|---|"]
    lines += [
        f"| {k} | {_cell(out['initial'][k], decimals[k])} | "
        f"{_cell(out['final'].get(k), decimals[k])} |"
        for k in shown
    ]
    lines += [
        "",
        f"Best round: {out['best_round']}; wall time {out['wall_seconds']:.0f} s.",
        "",
        f"![quality per round]({PLOTS_DIR}/quality_per_round.png)",
        "",
        "| round | pairs | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {r.get('num_pairs', '-')} | "
            + " | ".join(_cell(r.get(k), decimals[k]) for k in columns)
            + " |"
        )
    path = workdir / REPORT_FILE
    path.write_text("\n".join(lines) + "\n")
    return path
