"""Where a `loop` run's time went, from its summary.json: the per-phase breakdown of its rounds
and when its gate was first met.

    python scripts/loop_phases.py runs/tictactoe/summary.json [--from-round 5]

Prints a markdown table: for each phase of a round (collection, pairs, setup, tokenization,
compile, training, checkpoint, export, evaluation, and `other`, what no phase covers), the mean
wall seconds over the rounds from `--from-round` on, their share of the round, and the mean
process-CPU seconds; then the rounds, the loop's wall time and the gate line. Rounds 1-4 of the
tic-tac-toe recipe train on fewer pairs (the replay fills up to loop.max_train_pairs by round
5), so the default `--from-round 5` describes a round at full size.

A summary written before `loop.gate` existed has no gate and no phase times; `--gate
"optimal_move_rate>=0.95,illegal_move_rate<=0,losses_total<=0"` judges its rounds by their
figures, and takes the first one's end from the workdir's loop_state.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from dpojax.collect.gate import Gate
from dpojax.jobs.train.report import gate_sentence


def phase_table(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The markdown rows of the per-phase breakdown of `rounds` (records of summary.json)."""
    if not rounds:
        return ["(no round with phase times)"]
    names = list(dict.fromkeys(k for r in rounds for k in r.get("phase_seconds", {})))
    total = fmean(r["seconds"] for r in rounds)
    rows = ["| phase | wall s (mean) | share | process CPU s (mean) |", "|---|---:|---:|---:|"]
    for name in names:
        wall = fmean(r["phase_seconds"].get(name, 0.0) for r in rounds)
        cpu = fmean(r["phase_cpu_seconds"].get(name, 0.0) for r in rounds)
        rows.append(f"| {name} | {wall:.2f} | {wall / total:.0%} | {cpu:.2f} |")
    other = total - sum(fmean(r["phase_seconds"].get(n, 0.0) for r in rounds) for n in names)
    rows.append(f"| other | {other:.2f} | {other / total:.0%} | |")
    cpu = fmean(r.get("cpu_seconds", 0.0) for r in rounds)
    rows.append(f"| **round** | **{total:.2f}** | 100% | **{cpu:.2f}** |")
    return rows


def judged_gate(summary: Mapping[str, Any], spec: str, started: Mapping[str, float]):
    """The `gate` block of a summary written without loop.gate: the rounds whose figures meet
    `spec`, and the first one's end in loop seconds (from loop_state.json's `round_started`)."""
    gate = Gate(spec)
    met = [r for r in summary["rounds"][1:] if gate.met(r)]
    first = met[0] if met else None
    seconds = None
    if first is not None and str(first["round"]) in started:
        seconds = started[str(first["round"])] + first["seconds"]
    return {
        "conditions": str(gate),
        "met_rounds": [r["round"] for r in met],
        "first_met_round": first["round"] if first else None,
        "first_met_seconds": seconds,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a loop's WORKDIR/summary.json")
    parser.add_argument("--from-round", type=int, default=5, help="first round to average")
    parser.add_argument(
        "--gate",
        default="",
        help="judge the rounds by this gate (loop.gate's form) when the run had none",
    )
    args = parser.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    if args.gate and "gate" not in summary:
        state = args.summary.with_name("loop_state.json")
        started = json.loads(state.read_text())["round_started"] if state.is_file() else {}
        summary["gate"] = judged_gate(summary, args.gate, started)
    rounds = [
        r for r in summary["rounds"] if r["round"] >= args.from_round and "phase_seconds" in r
    ]
    print("\n".join(phase_table(rounds)))
    print(
        f"\n{summary['rounds_done']} rounds, loop wall {summary['wall_seconds']:.0f} s, "
        f"stop: {summary['stop_reason']}, kept round {summary['best_round']}"
    )
    print(gate_sentence(summary) or "no gate (loop.gate)")


if __name__ == "__main__":
    main()
