"""Collection -> pairs -> training, round after round (iterative on-policy DPO).

Mode `collect`: one round of collection; writes events and pairs. Mode `loop`: `loop.rounds`
rounds of collect -> train -> evaluate, with the reference fixed at the initial model or reset to
each round's starting policy; the best policy by the workflow's evaluation is exported to
WORKDIR/export. Progress files follow NeMo Agent Toolkit's (`data_collection_progress.jsonl`,
`collection_history.json`, `final_metrics.json`; docs/customizer.md), plus `summary.json` and
`report.md`.

Several processes (docs/multihost.md#collection-in-loop-mode): each process collects its share
of the `collect.num_runs` runs (run i on process i mod N, each run with its own seeds, so the
events are those of a single process), every process gets every run's events in run order and
builds the same pairs, and all train each round together. Process 0 writes the round's files,
loads the initial model and runs the workflow's greedy evaluation, whose metrics it shares.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from dpojax.collect.policy import ModelPolicy
from dpojax.collect.runner import RUN_SEED_STRIDE, gather_runs, run_one
from dpojax.collect.workflow import RoundRank, Workflow, headline_metrics, load_workflow
from dpojax.data.events import TTCEvent, write_events
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair, build_pairs, dedup_pairs, sample_pairs
from dpojax.jobs import build
from dpojax.models import from_pretrained
from dpojax.train import hosts

log = logging.getLogger(__name__)

# loop.reference: the reference of every round is the initial model, or the round's own
# starting policy.
LOOP_REFERENCES = ("initial", "previous")


def make_workflow(config: ml_collections.ConfigDict) -> Workflow:
    """The configured workflow, built from its typed options (`collect.<name>.*`, when it
    declares any) and `collect.workflow_kwargs` (which win)."""
    c = config.collect
    options = c.get(c.workflow)
    kwargs = options.to_dict() if isinstance(options, ml_collections.ConfigDict) else {}
    return load_workflow(c.workflow, {**kwargs, **json.loads(c.workflow_kwargs or "{}")})


def _is_main() -> bool:
    return jax.process_index() == 0


def initial_model(config: ml_collections.ConfigDict, workdir: Path) -> Path:
    """model.path, or a fresh random tiny model (loop.init_tiny_model) created in the workdir
    (by process 0)."""
    if config.model.path:
        return Path(config.model.path)
    from dpojax.models.tiny import make_tiny_checkpoint

    path = workdir / "initial_model"
    if _is_main() and not (path / "config.json").is_file():
        overrides = json.loads(config.loop.init_model_overrides or "{}")
        make_tiny_checkpoint(
            path, config.loop.init_tiny_model, seed=config.loop.init_seed, **overrides
        )
    hosts.barrier("dpojax initial model")
    return path


def _policy(
    config: ml_collections.ConfigDict, model_dir: Path, seed: int, loaded=None
) -> ModelPolicy:
    model, tokenizer = loaded or from_pretrained(model_dir, build.compute_dtype(config))
    c = config.collect
    return ModelPolicy(
        model,
        tokenizer,
        max_new_tokens=c.max_new_tokens,
        temperature=c.temperature,
        top_k=c.top_k,
        top_p=c.top_p,
        distinct=c.distinct,
        seed=seed,
        greedy_max_new_tokens=c.eval_max_new_tokens or None,
    )


def evaluate_policy(config, workflow: Workflow, model_dir: Path) -> dict[str, float]:
    """The workflow's evaluation of the greedy policy in `model_dir` ({} without one), run by
    process 0 and shared with the others."""
    quality = None
    if _is_main() and hasattr(workflow, "evaluate"):
        policy = _policy(config, model_dir, config.seed)
        quality = {k: float(v) for k, v in workflow.evaluate(policy.greedy).items()}
    return hosts.broadcast_json(quality or {})


def _collect_runs(config, workflow: Workflow, model_dir: Path, round_index: int):
    """(events, run records) of the round's `collect.num_runs` runs, run i on process i mod N
    (each with its own policy seed: run 0's is the round's), gathered in run order."""
    c = config.collect
    mine = range(jax.process_index(), c.num_runs, jax.process_count())
    if jax.process_count() > 1:
        log.info("round %d: collection runs %s of %d here", round_index, list(mine), c.num_runs)
    loaded = from_pretrained(model_dir, build.compute_dtype(config)) if len(mine) else None
    results = {}
    for i in mine:
        policy = _policy(config, model_dir, config.seed + round_index + RUN_SEED_STRIDE * i, loaded)
        results[i] = run_one(
            workflow,
            policy.candidates,
            run_index=i,
            round_index=round_index,
            seed=config.seed * 7919 + round_index,
        )
        if results[i][1]["status"] == "failed" and not c.continue_on_collection_error:
            break
    if jax.process_count() > 1:
        shared = {
            i: ([e.to_dict() for e in events], {k: v for k, v in rec.items() if k != "exception"})
            for i, (events, rec) in results.items()
        }
        for part in hosts.allgather_json(shared):
            for i, (events, rec) in part.items():
                results.setdefault(int(i), ([TTCEvent.from_dict(e) for e in events], rec))
    ordered = [results[i] for i in sorted(results)]
    failed = [n for n, (_, rec) in enumerate(ordered) if rec["status"] == "failed"]
    if failed and not c.continue_on_collection_error:  # the runs up to the first failure
        ordered = ordered[: failed[0] + 1]
    return gather_runs(
        ordered,
        round_index=round_index,
        continue_on_collection_error=c.continue_on_collection_error,
    )


def collect_round(config, workflow: Workflow, model_dir: Path, round_dir: Path, round_index: int):
    """One round of collection: events, pairs (NAT semantics, dedup, seeded sampling), files
    (written by process 0; every process returns the same pairs)."""
    c = config.collect
    events, runs = _collect_runs(config, workflow, model_dir, round_index)
    result = build_pairs(
        events,
        ttc_step_name=c.ttc_step_name,
        exhaustive_pairs=c.exhaustive_pairs,
        min_score_diff=c.min_score_diff,
        max_pairs_per_turn=c.max_pairs_per_turn or None,
        reward_from_score_diff=c.reward_from_score_diff,
    )
    pairs = dedup_pairs(result.pairs) if c.deduplicate_pairs else list(result.pairs)
    if c.max_pairs:
        pairs = sample_pairs(pairs, c.max_pairs, config.seed + round_index)
    if _is_main():
        round_dir.mkdir(parents=True, exist_ok=True)
        write_events(events, round_dir / "events.jsonl")
        write_pairs(pairs, round_dir / "pairs.jsonl", format="trl")
    rewards = [p.metadata.get("reward", 0.0) for p in pairs] or [0.0]
    stats = {
        "round": round_index,
        "num_events": len(events),
        "num_pairs_built": len(result.pairs),
        "num_pairs": len(pairs),
        "avg_reward": float(np.mean(rewards)),
        "min_reward": float(np.min(rewards)),
        "max_reward": float(np.max(rewards)),
        "runs": runs,
    }
    return pairs, stats


def _progress_files(workdir: Path, run_id: str, history: list[dict[str, Any]], entry: dict):
    """NAT's data_collection_progress.jsonl (appended) and collection_history.json (rewritten)."""
    line = {
        "run_number": len(history) + 1,
        "timestamp": datetime.now(UTC).isoformat(),
        "run_id": run_id,
        "num_trajectories": entry["num_events"],
        "num_dpo_pairs": entry["num_pairs"],
        "avg_reward": entry["avg_reward"],
        "min_reward": entry["min_reward"],
        "max_reward": entry["max_reward"],
    }
    history.append(line)
    if not _is_main():
        return
    with open(workdir / "data_collection_progress.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    (workdir / "collection_history.json").write_text(json.dumps(history, indent=2))


def _training_pairs(config, per_round: list[list], round_index: int) -> list:
    """This round's pairs plus those of the previous `loop.replay_rounds` rounds (-1: all),
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
        pairs = dedup_pairs(pairs)
    keep = len(pairs)
    if config.loop.max_train_pairs:
        keep = min(keep, config.loop.max_train_pairs)
    if config.loop.whole_batches and keep >= config.train.batch_size:
        keep -= keep % config.train.batch_size
    if keep < len(pairs):
        pairs = sample_pairs(pairs, keep, config.seed + round_index)
    return pairs


def _train_config(config, model_dir: Path, reference: Path, pairs_path: Path):
    train = copy.deepcopy(config)
    train.mode = "train"
    train.model.path = str(model_dir)
    train.reference.path = "" if reference == model_dir else str(reference)
    train.data.train_path = str(pairs_path)
    train.data.eval_path = ""
    train.train.progress = False
    return train


def collect(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
    """Mode `collect`: one round of events and pairs with the current policy."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    workflow = make_workflow(config)
    model_dir = initial_model(config, workdir)
    _, stats = collect_round(config, workflow, model_dir, workdir, 0)
    _progress_files(workdir, "collect", [], stats)
    if _is_main():
        (workdir / "summary.json").write_text(json.dumps(stats, indent=2))
    hosts.barrier("dpojax collect done")
    return stats


class _Rounds:
    """The state of a `loop` run: rounds so far, the best one, the collection history."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: Path):
        self.config, self.workdir = config, workdir
        self.start = time.perf_counter()
        self.workflow = make_workflow(config)
        self.initial = initial_model(config, workdir)
        self.rank = RoundRank(config.loop.best_metric, config.loop.best_mode)
        self.initial_quality = evaluate_policy(config, self.workflow, self.initial)
        self.metrics = headline_metrics(self.workflow, self.initial_quality)
        log.info("round 0 (initial): %s", self._brief(self.initial_quality))
        self.rounds = [{"round": 0, "model": str(self.initial), **self.initial_quality}]
        self.best = (self.rank(self.initial_quality), 0, self.initial)
        self.current = self.initial
        self.history: list[dict[str, Any]] = []
        self.per_round: list[list[PreferencePair]] = []

    def _brief(self, quality: dict[str, float]) -> str:
        return ", ".join(f"{k} {quality[k]:.3f}" for k in self.metrics[:3] if k in quality)

    def over_budget(self, r: int, round_start: float, last_round: float) -> bool:
        budget = self.config.loop.max_wall_seconds
        elapsed = round_start - self.start
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

    def run_round(self, r: int) -> bool:
        """Collects, trains and evaluates round `r`; False when it collected no pairs."""
        from dpojax.jobs.train import train

        config, round_dir = self.config, self.workdir / f"round_{r:02d}"
        pairs, stats = collect_round(config, self.workflow, self.current, round_dir, r)
        _progress_files(self.workdir, f"round_{r:02d}", self.history, stats)
        if not pairs:
            log.warning("round %d: no pairs (all candidates scored alike); stopping", r)
            return False
        self.per_round.append(pairs)
        if _is_main():
            write_pairs(
                _training_pairs(config, self.per_round, r),
                round_dir / "train_pairs.jsonl",
                format="trl",
            )
        hosts.barrier(f"dpojax round {r} pairs")
        reference = self.initial if config.loop.reference == "initial" else self.current
        summary = train(
            _train_config(config, self.current, reference, round_dir / "train_pairs.jsonl"),
            round_dir / "train",
        )
        self.current = round_dir / "train" / "export"
        quality = evaluate_policy(config, self.workflow, self.current)
        log.info("round %d: %d pairs, %s", r, stats["num_pairs"], self._brief(quality))
        self.rounds.append(
            {
                "round": r,
                "model": str(self.current),
                "num_pairs": stats["num_pairs"],
                "train_loss": (summary.get("final_eval") or {}).get("loss"),
                **quality,
            }
        )
        value = self.rank(quality)
        if value is not None and (self.best[0] is None or value > self.best[0]):
            self.best = (value, r, self.current)
        return True

    def _ordered(self, quality: dict[str, Any]) -> dict[str, Any]:
        """`quality` with the headline metrics first."""
        return {k: quality.get(k) for k in self.metrics if k in quality} | {
            k: v for k, v in quality.items() if k not in self.metrics
        }

    def finish(self, stop_reason: str | None) -> dict[str, Any]:
        """Exports the best round and writes summary.json, final_metrics.json and report.md."""
        _, best_round, best_dir = self.best
        final = next(x for x in self.rounds if x["round"] == best_round)
        out = {
            "initial": self._ordered(self.initial_quality),
            "final": self._ordered(final),
            "best_round": best_round,
            "rounds": self.rounds,
            "stop_reason": stop_reason,
            "wall_seconds": time.perf_counter() - self.start,
        }
        if _is_main():
            self._write(out, best_round, best_dir)
        hosts.barrier("dpojax loop done")
        return out

    def _write(self, out: dict[str, Any], best_round: int, best_dir: Path) -> None:
        if (self.workdir / "export").exists():
            shutil.rmtree(self.workdir / "export")
        shutil.copytree(best_dir, self.workdir / "export")
        (self.workdir / "summary.json").write_text(json.dumps(out, indent=2, default=str))
        (self.workdir / "final_metrics.json").write_text(
            json.dumps(self._final_metrics(best_round), indent=2)
        )
        from dpojax.jobs.report import write_rounds_report

        plotted = list(dict.fromkeys([self.rank.keys[0], *self.metrics[:3]]))
        write_rounds_report(self.workdir, out, self.metrics, plotted)
        _print_table(out, self.metrics)

    def _final_metrics(self, best_round: int) -> dict[str, Any]:
        """NAT's final_metrics.json of a finetuning run."""
        history = self.history
        return {
            "run_id": self.workdir.name,
            "timestamp": datetime.now(UTC).isoformat(),
            "status": "completed",
            "message": f"{len(self.rounds) - 1} rounds; best round {best_round}",
            "progress": 100.0,
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


def loop(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
    """Mode `loop`: rounds of collect -> train -> evaluate; keeps and exports the best policy."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rounds = _Rounds(config, workdir)
    stop_reason, round_start, last_round = None, time.perf_counter(), 0.0
    for r in range(1, config.loop.rounds + 1):
        if hosts.broadcast_json(rounds.over_budget(r, round_start, last_round)):  # process 0's
            stop_reason = "max_wall_seconds"
            break
        if not rounds.run_round(r):
            stop_reason = "no pairs"
            break
        now = time.perf_counter()
        round_start, last_round = now, now - round_start
    return rounds.finish(stop_reason)


def _print_table(out: dict[str, Any], metrics: list[str]) -> None:
    keys = [k for k in metrics if k in out["initial"]]
    if not keys:
        return
    width = max(len(k) for k in keys)
    print(f"\n{'metric':<{width}}  {'initial':>9}  {'final':>9}")
    for k in keys:
        print(f"{k:<{width}}  {out['initial'][k]:>9.3f}  {out['final'][k]:>9.3f}")
    print(f"best round {out['best_round']}, {out['wall_seconds']:.0f} s wall\n")
