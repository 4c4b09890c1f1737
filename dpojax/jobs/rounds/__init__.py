"""Collection -> pairs -> training, round after round (iterative on-policy DPO).

Mode `loop` (mode `collect`, one round of collection, is `dpojax.jobs.rounds.collection`): `loop.rounds`
rounds of collect -> train -> evaluate, with the reference fixed at the initial model or reset to
each round's starting policy; the best policy by the workflow's evaluation is exported to
WORKDIR/export. Progress files follow NeMo Agent Toolkit's (`data_collection_progress.jsonl`,
`collection_history.json`, `final_metrics.json`; docs/customizer.md), plus `summary.json` and
`report.md`.

A loop keeps its progress in WORKDIR/loop_state.json (`dpojax.jobs.rounds.state`): a re-run of the
same command reuses every finished phase (no collection or evaluation is repeated, the wall-clock
budget goes on from where it was) and refuses a changed recipe before writing anything.
SIGTERM / SIGINT stop a collection or evaluation at once (it is redone on the next run) and a
training after its current step (with a checkpoint it resumes from); the loop then writes its
summary so far and returns (README.md#interruptions-and-restarts).

Several processes (docs/multihost.md#collection-in-loop-mode): each process collects its share
of the `collect.num_runs` runs (run i on process i mod N, each run with its own seeds, so the
events are those of a single process), every process gets every run's events in run order and
builds the same pairs, and all train each round together. Process 0 writes the round's files and
the loop state, loads the initial model and runs the workflow's greedy evaluation, whose metrics
it shares; every decision to stop (a signal, the wall-clock budget) is taken by all processes
together. The workdir must be shared storage.

Why one module of this length: `_Rounds` is the loop's state between runs, and each phase of a
round (collection, the training file, training, evaluation, the gate) resumes from the one
`LoopState` it writes; the collection itself is `dpojax.jobs.rounds.collection`, the loop state
`dpojax.jobs.rounds.state`, the notes and examples `notes` and `examples`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from dpojax import schema
from dpojax.collect.gate import Gate
from dpojax.collect.workflow import (
    RoundRank,
    headline_metrics,
    metric_labels,
)
from dpojax.config import Config
from dpojax.data.pair_files import read_pairs, write_pairs
from dpojax.data.pairs import dedup_pairs, sample_pairs
from dpojax.data.unpaired import read_unpaired, write_unpaired
from dpojax.interrupts import Interrupted, StopSignals
from dpojax.jobs import build
from dpojax.jobs.phases import ROUND_PHASES, PhaseTimes
from dpojax.jobs.rounds.collection import (
    evaluate_policy,
    gather_round,
    initial_model,
    is_main,
    make_workflow,
    progress_line,
    write_atomic,
    write_round,
)
from dpojax.jobs.rounds.examples import (
    TRAIN_UNPAIRED_FILE,
    UNPAIRED_FILE,
    dedup_examples,
)
from dpojax.jobs.rounds.notes import (
    AnswerLog,
    answers_changed,
    gate_note,
    gate_stop_line,
    movement_note,
    timing_line,
)
from dpojax.jobs.rounds.state import LoopState, prune_rounds, write_progress_files
from dpojax.jobs.train.trainer import StepperCache
from dpojax.jobs.workdir import atomic_write_text, check_config, replaced_dir
from dpojax.train import hosts

log = logging.getLogger(__name__)


def _training_pairs(config, per_round: list[list], round_index: int, dedup=dedup_pairs) -> list:
    """This round's pairs (or unpaired examples, with their `dedup`) plus those of the previous
    `loop.replay_rounds` rounds (-1: all),
    deduplicated across rounds (`loop.replay_dedup`; otherwise a pair collected in n rounds is
    there n times, so positions the policy visits often weigh more), then at most
    `loop.max_train_pairs` of them (seeded sample), rounded down to a multiple of
    `train.batch_size` with `loop.whole_batches` (when there is at least one batch).
    With an exact scorer, pairs from earlier rounds stay correct, and replaying them keeps
    positions the current policy no longer visits."""
    replay = config.loop.replay_rounds
    window = per_round if replay < 0 else per_round[-(replay + 1) :]
    pairs = [p for round_pairs in reversed(window) for p in round_pairs]
    if config.loop.replay_dedup:
        pairs = dedup(pairs)
    keep = len(pairs)
    if config.loop.max_train_pairs:
        keep = min(keep, config.loop.max_train_pairs)
    if config.loop.whole_batches and keep >= config.train.batch_size:
        keep -= keep % config.train.batch_size
    if keep < len(pairs):
        pairs = sample_pairs(pairs, keep, config.seed + round_index)
    return pairs


def _train_config(config: Config, model_dir: Path, reference: Path, pairs_path: Path) -> Config:
    changes = {
        "mode": "train",
        "model.path": str(model_dir),
        "reference.path": "" if reference == model_dir else str(reference),
        "data.train_path": str(pairs_path),
        "data.eval_path": "",
        "train.progress": False,
    }
    if build.unpaired_loss(config):
        changes["data.format"] = "unpaired"
    return schema.replaced(config, changes)


class _Rounds:
    """A `loop` run: its persisted state (`LoopState`), the workflow, the best round so far."""

    def __init__(self, config: Config, workdir: Path, stop: StopSignals):
        self.config, self.workdir, self.stop = config, workdir, stop
        self.start = time.perf_counter()
        self.state = _load_state(workdir)
        self.base_elapsed = self.state.elapsed_seconds
        self.workflow = make_workflow(config)
        self.initial = initial_model(config, workdir)
        self.rank = RoundRank(config.loop.best_metric, config.loop.best_mode)
        self.gate = Gate(config.loop.gate)
        self.metrics: list[str] = []
        self.answers: dict[str, str] | None = None  # the last evaluation's, when this run made it
        self.items_read: dict[int, list] = {}  # round -> its pairs or unpaired examples
        # round 1's auto-fit decision: later rounds (same shapes) take it without compiling
        self.fit: dict[str, Any] | None = None
        self.steppers = StepperCache()  # and its jitted steps, which later rounds reuse

    # -- bookkeeping ----------------------------------------------------------------------

    def elapsed(self) -> float:
        """Wall seconds of this loop over every run so far."""
        return self.base_elapsed + time.perf_counter() - self.start

    def save(self) -> None:
        """loop_state.json (process 0; every process keeps the same state)."""
        self.state.elapsed_seconds = self.elapsed()
        if is_main():
            self.state.save(self.workdir)

    def _brief(self, quality: dict[str, float]) -> str:
        return ", ".join(f"{k} {quality[k]:.3f}" for k in self.metrics[:3] if k in quality)

    def _last_round_seconds(self) -> float:
        return self.state.rounds[-1].get("seconds", 0.0) if len(self.state.rounds) > 1 else 0.0

    def over_budget(self, r: int) -> bool:
        budget, elapsed = self.config.loop.max_wall_seconds, self.elapsed()
        last_round = self._last_round_seconds()
        if budget and r > 1 and elapsed + last_round > budget:
            log.info(
                "stopping after round %d: %.0f s elapsed, and a round of %.0f s more would pass "
                "loop.max_wall_seconds=%g",
                r - 1,
                elapsed,
                last_round,
                budget,
            )
            return True
        return False

    def _announce(self, r: int) -> None:
        budget, n = self.config.loop.max_wall_seconds, self.config.loop.rounds
        left = (
            f", {budget - self.elapsed():.0f} s of the {budget:g} s budget left" if budget else ""
        )
        log.info("round %d of %d (%.0f s elapsed%s)", r, n, self.elapsed(), left)

    # -- phases ---------------------------------------------------------------------------

    def _check_gate(self, quality: dict[str, float]) -> None:
        missing = self.gate.missing(quality)
        if missing:
            raise ValueError(
                f"config key 'loop.gate' names {', '.join(missing)}, which the workflow's "
                f"evaluation does not report; it reports {', '.join(quality) or 'nothing'}"
            )

    def evaluate_initial(self) -> None:
        if self.state.initial is None:
            answers = AnswerLog(None)
            with self.stop.interruptible():
                quality = evaluate_policy(self.config, self.workflow, self.initial, answers)
            self._check_gate(quality)
            self.answers = answers.answers
            self.state.initial = quality
            self.state.rounds = [{"round": 0, "model": str(self.initial), **quality}]
            self.state.best_round, self.state.best_value = 0, _listed(self.rank(quality))
            self.save()
            self.metrics = headline_metrics(self.workflow, quality)
            log.info("round 0 (initial): %s", self._brief(quality))
            return
        self._check_gate(self.state.initial)
        self.metrics = headline_metrics(self.workflow, self.state.initial)
        log.info("round 0 (initial, evaluated before): %s", self._brief(self.state.initial))

    def _collected(self, r: int, model_dir: Path, round_dir: Path) -> dict[str, Any]:
        """Round `r`'s collection statistics, collecting first unless a run did already; the
        statistics keep the collection's phase times."""
        stats = self.state.collected.get(str(r))
        if stats is not None:
            return stats
        self.state.round_started[str(r)] = self.elapsed()
        times = PhaseTimes()
        with self.stop.interruptible():
            events, pairs, stats, examples = gather_round(
                self.config, self.workflow, model_dir, r, times
            )
        with times.phase("pairs"):
            write_round(round_dir, events, pairs, examples)
        stats["phase_seconds"], stats["phase_cpu_seconds"] = times.rounded()
        run_number = len(self.state.history) + 1
        self.state.history.append(progress_line(run_number, f"round_{r:02d}", stats))
        self.state.collected[str(r)] = stats
        self.save()
        if is_main():
            write_progress_files(self.workdir, self.state.history)
        return stats

    def _training_file(self, r: int, round_dir: Path) -> Path:
        """Round `r`'s training file (written by process 0 unless a run did already): its pairs
        and the replayed rounds' (`_training_pairs`), or with an unpaired loss its examples."""
        if build.unpaired_loss(self.config):
            path, write, dedup = round_dir / TRAIN_UNPAIRED_FILE, write_unpaired, dedup_examples
        else:
            path, dedup = round_dir / "train_pairs.jsonl", dedup_pairs

            def write(pairs, out):
                return write_pairs(pairs, out, format="trl")

        if is_main() and not path.is_file():
            per_round = [self._round_items(k) for k in range(1, r + 1)]
            write_atomic(write, _training_pairs(self.config, per_round, r, dedup), path)
        hosts.barrier(f"dpojax round {r} pairs")
        return path

    def _round_items(self, r: int) -> list:
        """What round `r` trains on: the pairs it collected, or with an unpaired loss the
        examples it labelled (read back from its pairs.jsonl / unpaired.jsonl once per run: the
        replay of round 30 reads 29 earlier rounds)."""
        if build.unpaired_loss(self.config):
            count, name = "num_examples", UNPAIRED_FILE

            def read(path):
                return read_unpaired(path, strict=True)[0]
        else:
            count, name = "num_pairs", "pairs.jsonl"

            def read(path):
                return read_pairs(path, format="trl")[0]

        if not self.state.collected.get(str(r), {}).get(count):
            return []
        if r not in self.items_read:
            self.items_read[r] = read(self.workdir / f"round_{r:02d}" / name)
        return self.items_read[r]

    def run_round(self, r: int) -> str | None:
        """Collects, trains and evaluates round `r`; a stop reason, or None when it finished."""
        from dpojax.jobs.train import train

        config, round_dir = self.config, self.workdir / f"round_{r:02d}"
        current = self.state.model_of(r - 1, self.initial)
        cpu, collected_before = time.process_time(), str(r) in self.state.collected
        stats = self._collected(r, current, round_dir)
        if build.unpaired_loss(config) and not stats["num_examples"]:
            log.warning("round %d: no unpaired examples (data.unpaired labelled none); stopping", r)
            return "no examples"
        if not stats["num_pairs"] and not build.unpaired_loss(config):
            log.warning("round %d: no pairs (all candidates scored alike); stopping", r)
            return "no pairs"
        times = PhaseTimes(ROUND_PHASES)
        times.update(stats.get("phase_seconds", {}), stats.get("phase_cpu_seconds"))
        with times.phase("pairs"):
            train_pairs = self._training_file(r, round_dir)
        reference = self.initial if config.loop.reference == "initial" else current
        train_config = _train_config(config, current, reference, train_pairs)
        if (
            reference == self.initial
            and config.reference.type == "precomputed"
            and not config.reference.cache_dir
        ):
            # one store for the run: a replayed pair's reference log-probs are computed once
            cache = str(self.workdir / "reference_cache")
            train_config = schema.replaced(train_config, {"reference.cache_dir": cache})
        # No last checkpoint: a completed training is known by its summary and export.
        summary = _finished_training(round_dir / "train") or train(
            train_config,
            round_dir / "train",
            stop=self.stop,
            final_checkpoint=False,
            fit=self.fit,
            batch_over_pairs=True,  # a round's pairs vary: a batch is all of them
            steppers=self.steppers,
        )
        self.fit = self.fit or summary.get("auto_fit")
        if summary["status"] != "completed":
            return summary["status"]
        times.update(summary.get("phase_seconds", {}), summary.get("phase_cpu_seconds"))
        model = round_dir / "train" / "export"
        answers = AnswerLog(None)
        with self.stop.interruptible(), times.phase("evaluation"):
            quality = evaluate_policy(config, self.workflow, model, answers)
        record = {
            "round": r,
            "model": str(model),
            "num_pairs": stats["num_pairs"],
            "train_loss": _train_loss(summary),
            "greedy_answers": self._compare_answers(answers.answers),
            **quality,
        }
        if "num_examples" in stats:
            record["num_examples"] = stats["num_examples"]
        cpu = time.process_time() - cpu
        if collected_before:  # by an earlier run: its collection's CPU time
            cpu += sum(stats.get("phase_cpu_seconds", {}).values())
        self._finish_round(record, times, cpu)
        return None

    def _compare_answers(self, answers: dict[str, str]) -> dict[str, int] | None:
        """How many greedy answers changed since the previous evaluation (None when this run
        did not make it), on process 0 and shared."""
        change = None
        if is_main() and self.answers is not None:
            change = answers_changed(self.answers, answers)
        self.answers = answers if is_main() else None
        return hosts.broadcast_json(change)

    def gate_done(self, r: int) -> bool:
        """Whether the gate has held for loop.gate_rounds rounds before round `r` (so the loop
        stops there)."""
        needed = self.config.loop.gate_rounds
        if needed and self.gate_held() >= needed:
            log.info("%s", gate_stop_line(r - 1, self.gate, needed))
            return True
        return False

    def gate_held(self) -> int:
        """For how many consecutive rounds, up to the last one finished, the gate has held."""
        held = 0
        for record in reversed(self.state.rounds[1:]):
            if not record.get("gate_met"):
                break
            held += 1
        return held

    def _finish_round(self, record: dict[str, Any], times: PhaseTimes, cpu: float) -> None:
        r, quality = record["round"], {k: v for k, v in record.items() if k in self.metrics}
        previous = self.state.rounds[-1] if self.state.rounds else {}
        started = self.state.round_started.get(str(r), self.elapsed())
        record["seconds"] = self.elapsed() - started
        record["elapsed_seconds"] = self.elapsed()
        record["phase_seconds"], record["phase_cpu_seconds"] = times.rounded()
        record["cpu_seconds"] = round(cpu, 3)
        if self.gate:
            record["gate_met"] = self.gate.met(record)
        self.state.rounds.append(record)
        same = bool(quality) and all(previous.get(k) == v for k, v in quality.items())
        parts = [
            f"round {r}: {record['num_pairs']} pairs, {self._brief(record)}",
            movement_note(r, record["greedy_answers"], same, record["train_loss"]),
            gate_note(self.gate, record, self.gate_held(), self.config.loop.gate_rounds),
        ]
        log.info("%s", "; ".join(p for p in parts if p))
        log.info("%s", timing_line(r, record))
        value, best = self.rank(record), self.state.best_value
        if value is not None and (best is None or tuple(value) > tuple(best)):
            self.state.best_round, self.state.best_value = r, list(value)
        self.save()
        self.prune()

    def prune(self) -> None:
        """Drops what finished rounds no longer need (unless loop.keep_round_files)."""
        if self.config.loop.keep_round_files or len(self.state.rounds) < 2 or not is_main():
            return
        prune_rounds(
            self.workdir, self.state, {self.state.best_round, self.state.rounds[-1]["round"]}
        )

    def run(self) -> str | None:
        """Rounds up to loop.rounds; the stop reason (None: all rounds ran)."""
        try:
            self.evaluate_initial()
            self.prune()
            for r in range(1, self.config.loop.rounds + 1):
                if self.state.finished(r):
                    continue
                if hosts.any_process(self.stop.received is not None):  # all stop together
                    return f"stopped by {self.stop.received or 'a signal to another process'}"
                if self.gate_done(r):
                    return "gate_rounds"
                if hosts.broadcast_json(self.over_budget(r)):  # process 0's clock decides
                    return "max_wall_seconds"
                self._announce(r)
                reason = self.run_round(r)
                if reason is not None:
                    return reason
        except Interrupted as e:
            return f"stopped by {e.signal_name}"
        return None

    # -- the end --------------------------------------------------------------------------

    def _gate_summary(self) -> dict[str, Any]:
        """The gate, the rounds that met it, and the first of them with the loop's wall time at
        its end."""
        met = [x for x in self.state.rounds[1:] if x.get("gate_met")]
        first = met[0] if met else {}
        return {
            "conditions": str(self.gate),
            "rounds_needed": self.config.loop.gate_rounds,
            "met_rounds": [x["round"] for x in met],
            "first_met_round": first.get("round"),
            "first_met_seconds": first.get("elapsed_seconds"),
            "held_at_end": self.gate_held(),
            "best_round_meets_it": self.gate.met(self.state.finished(self.state.best_round) or {}),
        }

    def _ordered(self, quality: dict[str, Any]) -> dict[str, Any]:
        """`quality` with the headline metrics first."""
        return {k: quality.get(k) for k in self.metrics if k in quality} | {
            k: v for k, v in quality.items() if k not in self.metrics
        }

    def finish(self, stop_reason: str | None) -> dict[str, Any]:
        """Exports the best round and writes summary.json, final_metrics.json and report.md
        (after a stop too: the rounds finished so far)."""
        status = stop_reason if (stop_reason or "").startswith("stopped by") else "completed"
        rounds, best_round = self.state.rounds, self.state.best_round
        out: dict[str, Any] = {
            "status": status,
            "initial": self._ordered(self.state.initial or {}),
            "final": {},
            "best_round": best_round,
            "rounds": rounds,
            "rounds_done": max(len(rounds) - 1, 0),
            "stop_reason": stop_reason,
            "wall_seconds": self.elapsed(),
        }
        if self.gate:
            out["gate"] = self._gate_summary()
        if rounds:
            out["final"] = self._ordered(self.state.finished(best_round) or rounds[0])
        self.save()
        if is_main():
            self._write(out, best_round, status)
        hosts.barrier("dpojax loop done")
        return out

    def _write(self, out: dict[str, Any], best_round: int, status: str) -> None:
        """Process 0's files at the end: the export, summary.json, final_metrics.json, report."""
        rounds = self.state.rounds
        if rounds:
            with replaced_dir(self.workdir / "export") as tmp:
                shutil.copytree(self.state.model_of(best_round, self.initial), tmp)
        atomic_write_text(self.workdir / "summary.json", json.dumps(out, indent=2, default=str))
        atomic_write_text(
            self.workdir / "final_metrics.json",
            json.dumps(self._final_metrics(best_round, status), indent=2),
        )
        if rounds and self.metrics:
            from dpojax.jobs.train.report import write_rounds_report

            plotted = list(dict.fromkeys([*self.rank.keys[:1], *self.metrics[:3]]))
            labels = metric_labels(self.workflow, out["initial"])
            write_rounds_report(self.workdir, out, self.metrics, plotted, labels)
            _print_table(out, self.metrics, labels)

    def _final_metrics(self, best_round: int, status: str) -> dict[str, Any]:
        """NAT's final_metrics.json of a finetuning run."""
        history = self.state.history
        done = max(len(self.state.rounds) - 1, 0)
        return {
            "run_id": self.workdir.name,
            "timestamp": datetime.now(UTC).isoformat(),
            "status": status,
            "message": f"{done} rounds; best round {best_round}",
            "progress": 100.0 if status == "completed" else 100.0 * done / self.config.loop.rounds,
            "num_collection_runs": len(history),
            "total_trajectory_groups": sum(h["num_trajectories"] for h in history),
            "collection_summary": {
                "total_trajectories": sum(h["num_trajectories"] for h in history),
                "total_dpo_pairs": sum(h["num_dpo_pairs"] for h in history),
                "avg_reward": float(np.mean([h["avg_reward"] for h in history]))
                if history
                else 0.0,
            },
        }


def _load_state(workdir: Path) -> LoopState:
    """The workdir's loop state as process 0 reads it (a fresh one when there is none)."""
    mine = asdict(LoopState.load(workdir) or LoopState()) if is_main() else None
    return LoopState(**hosts.broadcast_json(mine))


def _finished_training(train_dir: Path) -> dict[str, Any] | None:
    """The summary of a round's training that an earlier run completed (its export written
    before its summary.json), as process 0 reads it; None when there is none."""
    summary = None
    path = train_dir / "summary.json"
    if is_main() and path.is_file() and (train_dir / "export" / "config.json").is_file():
        found = json.loads(path.read_text())
        summary = found if found.get("status") == "completed" else None
    return hosts.broadcast_json(summary)


def _listed(value) -> list[float] | None:
    return None if value is None else [float(v) for v in value]


def _train_loss(summary: dict[str, Any]) -> float | None:
    """A round's training loss: the last step's (the evaluation's when there was one)."""
    for key in ("final_eval", "final_train"):
        metrics = summary.get(key) or {}
        if metrics.get("loss") is not None:
            return float(metrics["loss"])
    return None


def loop(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Mode `loop`: rounds of collect -> train -> evaluate; keeps and exports the best policy.
    A re-run continues the workdir's loop (module docstring)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop:
        resuming = LoopState.load(workdir) is not None
        if is_main():
            check_config(config, workdir, resuming=resuming)  # before anything else is written
        if resuming:
            log.info("continuing the loop in %s", workdir)
        rounds = _Rounds(config, workdir, stop)
        stop_reason = rounds.run()
        return rounds.finish(stop_reason)


def _print_table(out: dict[str, Any], metrics: list[str], labels: dict[str, str]) -> None:
    """The initial and final values of `metrics`: rates with 3 decimals, counts (ints) as
    integers, each name with its label (what a count counts)."""
    from dpojax.jobs.train.report import labelled

    keys = [k for k in metrics if k in out["initial"]]
    if not keys:
        return
    names = {k: labelled(k, labels) for k in keys}
    width = max(len(n) for n in names.values())
    cell = lambda v: f"{v:>9d}" if isinstance(v, int) else f"{v:>9.3f}"  # noqa: E731
    print(f"\n{'metric':<{width}}  {'initial':>9}  {'final':>9}")
    for k in keys:
        print(f"{names[k]:<{width}}  {cell(out['initial'][k])}  {cell(out['final'][k])}")
    print(f"best round {out['best_round']}, {out['wall_seconds']:.0f} s wall\n")
