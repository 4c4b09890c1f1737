"""End-of-run report: `WORKDIR/report.md` with PNG plots of the metrics in metrics.jsonl.

Why one module of this length: the report's sections (run, throughput, losses and rewards, the
evaluation, the plots, a loop's rounds) read the same metrics records and share their formatting;
each section is a short function.
"""

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

from dpojax.jobs.train.progress import duration
from dpojax.train.metrics_io import RESERVED_KEYS, read_metrics
from dpojax.train.timing import report_lines as timing_lines

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
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


def human_bytes(value: float) -> str:
    """1.50 GiB, 12.0 MiB, 512 B."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.{2 if unit in ('TiB', 'GiB') else 1}f} {unit}"
    return f"{value:.0f} B"


def human_duration(seconds: float) -> str:
    """0.25 s, 12.3 s, 2m10s, 1h02m."""
    if seconds < 1:
        return f"{seconds:.2g} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return duration(seconds)


def human_rate(value: float, unit: str) -> str:
    """2,068 tokens/s, 1.06 pairs/s, 0.266 steps/s (three significant digits below 100)."""
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{text} {unit}/s"


# summary.json keys by how they end: the rendering of their value in report.md.
_RATE_SUFFIXES = ("_per_second", "_per_s")


def summary_value(key: str, value: Any) -> str:
    """A summary.json value in human units, by its key: *_bytes as MiB / GiB, *_seconds as a
    duration, X_per_second as X/s; anything else as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        if key == "bytes" or key.endswith("_bytes"):
            return human_bytes(value)
        if key == "seconds" or key.endswith("_seconds"):
            return human_duration(value)
        for suffix in _RATE_SUFFIXES:
            if key.endswith(suffix):
                return human_rate(value, key.removesuffix(suffix))
    if isinstance(value, Mapping) and all(not isinstance(v, Mapping) for v in value.values()):
        return _fmt(", ".join(f"{k}={v}" for k, v in value.items()))
    return _fmt(value)


@dataclass(frozen=True)
class MetricRow:
    """One row of report.md's final-metrics table: a metric under one name, what it means and
    how its value reads."""

    name: str
    meaning: str
    kind: str = "number"  # number, count, rate (tokens/s), percent


# The final-metrics table, in this order; metrics not listed follow alphabetically.
METRIC_ROWS = (
    MetricRow("loss", "the optimized loss: preference term (+ weighted SFT term)"),
    MetricRow("preference_loss", "the preference term alone"),
    MetricRow("sft_loss", "NLL of the chosen response: the SFT term before its weight"),
    MetricRow("rewards/accuracies", "pairs whose chosen reward beats the rejected", "percent"),
    MetricRow("rewards/margins", "mean chosen - rejected reward (beta-scaled)"),
    MetricRow("rewards/chosen", "mean implicit reward of chosen (beta-scaled)"),
    MetricRow("rewards/rejected", "mean implicit reward of rejected (beta-scaled)"),
    MetricRow("rewards_all_mean", "mean implicit reward of all responses before beta"),
    MetricRow("rewards_all_std", "their standard deviation"),
    MetricRow("logps/chosen", "mean policy log-prob of chosen"),
    MetricRow("logps/rejected", "mean policy log-prob of rejected"),
    MetricRow("learning_rate", "learning rate of the last step"),
    MetricRow("grad_norm", "global gradient norm"),
    MetricRow("tokens_per_s", "training throughput of the last step", "rate"),
    MetricRow("tokens", "tokens in the last step", "count"),
    MetricRow("pairs", "pairs in the last step", "count"),
    MetricRow(
        "nonfinite", "1 where the last step's loss, gradient or update was not finite", "count"
    ),
)
# metrics.jsonl names that repeat another metric by construction (kept there for the tools that
# read them, e.g. NeMo Customizer's): left out of report.md's table, named under it.
REPEATS = {
    "acc": "rewards/accuracies",
    "rewards_chosen_mean": "rewards/chosen before the beta scaling",
    "rewards_rejected_mean": "rewards/rejected before the beta scaling",
}
# preference_loss is loss without an SFT term: shown only where the two differ.
_SAME_AS_LOSS = "preference_loss"
METRIC_ORDER = tuple(row.name for row in METRIC_ROWS)
_ROWS = {row.name: row for row in METRIC_ROWS}


def metric_value(name: str, value: Any) -> str:
    """A final metric as report.md shows it: accuracies as percent, throughput as tokens/s,
    counts as integers, other numbers with 4 significant digits."""
    kind = _ROWS[name].kind if name in _ROWS else "number"
    number = _as_float(value)
    if number is None or not math.isfinite(number):
        return _fmt(value)
    if kind == "percent":
        return f"{100 * number:.1f}%"
    if kind == "rate":
        return human_rate(number, "tokens")
    if kind == "count" and number == int(number):
        return f"{int(number):,}"
    return f"{number:.4g}"


def _metric_sort_key(name: str) -> tuple[int, str]:
    return (METRIC_ORDER.index(name), "") if name in METRIC_ORDER else (len(METRIC_ORDER), name)


def _shown_metrics(finals: Mapping[str, tuple[int, dict[str, Any]]]) -> list[str]:
    """The table's metric names: one per metric (REPEATS left out, preference_loss only where
    it differs from loss)."""
    names = {k for _, values in finals.values() for k in values} - set(REPEATS)
    if all(
        math.isclose(v[_SAME_AS_LOSS], v["loss"], rel_tol=1e-6, abs_tol=1e-12)
        for _, v in finals.values()
        if _as_float(v.get(_SAME_AS_LOSS)) is not None and _as_float(v.get("loss")) is not None
    ):
        names.discard(_SAME_AS_LOSS)
    return sorted(names, key=_metric_sort_key)


def metric_rows(values: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, value as shown, meaning) of one split's final metrics, one row per metric (the
    model card's table)."""
    return [
        (name, metric_value(name, values[name]), _ROWS[name].meaning if name in _ROWS else "")
        for name in _shown_metrics({"split": (0, dict(values))})
    ]


def _metrics_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    finals = final_metrics(records)
    splits = _splits(records)
    names = _shown_metrics(finals)
    header = " | ".join(f"{s} (step {finals[s][0]})" for s in splits)
    lines = [f"| metric | {header} | meaning |", "|---" * (len(splits) + 2) + "|"]
    for name in names:
        cells = [
            metric_value(name, finals[s][1][name]) if name in finals[s][1] else "-" for s in splits
        ]
        meaning = _ROWS[name].meaning if name in _ROWS else ""
        lines.append(f"| {_fmt(name)} | " + " | ".join(cells) + f" | {meaning} |")
    present = {k for _, v in finals.values() for k in v}
    left_out = [f"{k} ({of})" for k, of in REPEATS.items() if k in present]
    if _SAME_AS_LOSS in present and _SAME_AS_LOSS not in names:
        left_out.append(f"{_SAME_AS_LOSS} (loss: no SFT term)")
    if left_out:
        lines += [
            "",
            "Also in metrics.jsonl under other tools' names: " + "; ".join(left_out) + ".",
        ]
    return lines


def _nested(value: Any) -> bool:
    return isinstance(value, Mapping) and any(
        isinstance(v, Mapping | list | tuple) for v in value.values()
    )


def _summary_row(key: str, value: Any) -> list[str]:
    """The rows of one summary.json entry: a record that carries its own sentence (`line`, as
    auto-fit's does) shows that sentence; another nested record one row per entry, named
    `key.entry`; an empty one "none"; anything else one row in human units."""
    if isinstance(value, Mapping) and isinstance(value.get("line"), str):
        return [f"| {_fmt(key)} | {_fmt(value['line'])} |"]
    if _nested(value):
        return [row for k, v in value.items() for row in _summary_row(f"{key}.{k}", v)]
    if isinstance(value, Mapping) and not value:
        return [f"| {_fmt(key)} | none |"]
    return [f"| {_fmt(key)} | {summary_value(key.rsplit('.', 1)[-1], value)} |"]


def _summary_rows(summary: Mapping[str, Any]) -> list[str]:
    """summary.json as table rows in human units (no raw JSON); its final_* metric sets are
    left to the final-metrics table (the same last values, from metrics.jsonl)."""
    return [
        row
        for k, v in summary.items()
        if not (k.startswith("final_") and isinstance(v, Mapping | type(None)))
        for row in _summary_row(k, v)
    ]


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
        out += _summary_rows({k: v for k, v in summary.items() if k != "timing"})
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
    """A number with `decimals` decimals; a count (an int) as an integer; "-" for none."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    return f"{value:.{decimals}f}" if isinstance(value, numbers.Real) else "-"


def labelled(name: str, labels: Mapping[str, str]) -> str:
    """`name (what it is)` where `labels` says what it is, else `name`."""
    return f"{name} ({labels[name]})" if name in labels else name


def gate_sentence(out: Mapping[str, Any]) -> str:
    """`Gate `...`: first met at round r, s s into the loop; met in rounds ...` of a loop's
    summary ("" without a gate)."""
    gate = out.get("gate")
    if not gate:
        return ""
    if gate["first_met_round"] is None:
        return f"Gate `{gate['conditions']}`: not met."
    seconds = gate.get("first_met_seconds")
    when = f", {seconds:.0f} s into the loop" if seconds is not None else ""
    return (
        f"Gate `{gate['conditions']}`: first met at round {gate['first_met_round']}{when}; "
        f"met in rounds {', '.join(map(str, gate['met_rounds']))}."
    )


def write_rounds_report(
    workdir: str | os.PathLike[str],
    out: Mapping[str, Any],
    metrics: Sequence[str],
    plotted: Sequence[str],
    labels: Mapping[str, str] | None = None,
) -> Path:
    """`WORKDIR/report.md` of a loop run (`out` is its summary): the initial and final values of
    `metrics` (named with their `labels`; counts as integers), a plot of `plotted` per round and
    a table of every round."""
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
        f"| {labelled(k, labels or {})} | {_cell(out['initial'][k], decimals[k])} | "
        f"{_cell(out['final'].get(k), decimals[k])} |"
        for k in shown
    ]
    best = f"Best round: {out['best_round']}; wall time {out['wall_seconds']:.0f} s."
    gate = gate_sentence(out)
    lines += [
        "",
        f"{best} {gate}" if gate else best,
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
