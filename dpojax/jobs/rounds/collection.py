"""Mode `collect`: one round of on-policy collection, and the pieces a loop's rounds share.

The workflow (`make_workflow`) runs `collect.num_runs` times with the round's policy (on several
processes, each its share of the runs: docs/multihost.md#collection-in-loop-mode); every process
gets every run's events in run order (`gather_round`) and builds the same preference pairs (or,
for an unpaired loss, labelled examples); process 0 writes them (`write_round`: events.jsonl,
pairs.jsonl, unpaired.jsonl) and the progress lines NeMo Agent Toolkit writes (`progress_line`).
`initial_model` and `evaluate_policy` give a loop its starting policy and its greedy evaluation
(`dpojax.jobs.rounds`).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from dpojax import schema
from dpojax.collect.policy import ModelPolicy
from dpojax.collect.runner import RUN_SEED_STRIDE, gather_runs, run_one
from dpojax.collect.workflow import (
    Workflow,
    load_workflow,
)
from dpojax.config import Config
from dpojax.data.events import TTCEvent, write_events
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair, build_pairs, dedup_pairs, sample_pairs
from dpojax.data.unpaired import UnpairedExample, write_unpaired
from dpojax.interrupts import Interrupted, StopSignals
from dpojax.jobs import build
from dpojax.jobs.phases import PhaseTimes
from dpojax.jobs.rounds.examples import (
    UNPAIRED_FILE,
    label_events,
)
from dpojax.jobs.rounds.notes import (
    AnswerLog,
)
from dpojax.jobs.rounds.state import write_progress_files
from dpojax.jobs.workdir import atomic_write_text, replaced_dir
from dpojax.models import from_pretrained
from dpojax.train import hosts

log = logging.getLogger(__name__)


def make_workflow(config: Config) -> Workflow:
    """The configured workflow, built from its typed options (`collect.<name>.*`, when it
    declares any) and `collect.workflow_kwargs` (which win)."""
    c = config.collect
    kwargs = schema.plain(c.workflows.get(c.workflow, {}))
    return load_workflow(c.workflow, {**kwargs, **json.loads(c.workflow_kwargs or "{}")})


def is_main() -> bool:
    return jax.process_index() == 0


def initial_model(config: Config, workdir: Path) -> Path:
    """model.path, or a fresh random tiny model (loop.init_tiny_model) created in the workdir
    (by process 0)."""
    if config.model.path:
        return Path(config.model.path)
    from dpojax.models.tiny import make_tiny_checkpoint

    path = workdir / "initial_model"
    if is_main() and not (path / "config.json").is_file():
        overrides = json.loads(config.loop.init_model_overrides or "{}")
        with replaced_dir(path) as tmp:  # whole or not at all
            make_tiny_checkpoint(
                tmp, config.loop.init_tiny_model, seed=config.loop.init_seed, **overrides
            )
    hosts.barrier("dpojax initial model")
    return path


def _policy(config: Config, model_dir: Path, seed: int, loaded=None) -> ModelPolicy:
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


def evaluate_policy(
    config, workflow: Workflow, model_dir: Path, answers: AnswerLog | None = None
) -> dict[str, float]:
    """The workflow's evaluation of the greedy policy in `model_dir` ({} without one), run by
    process 0 and shared with the others; `answers` (process 0's) gets every greedy answer."""
    quality = None
    if is_main() and hasattr(workflow, "evaluate"):
        policy = _policy(config, model_dir, config.seed)
        greedy = policy.greedy
        if answers is not None:
            answers.greedy, greedy = greedy, answers
        quality = {k: float(v) for k, v in workflow.evaluate(greedy).items()}
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


class Collected(NamedTuple):
    """A round's collection: its events, pairs, statistics and, with an unpaired loss, its
    labelled examples (`dpojax.jobs.rounds.examples`; else None)."""

    events: list[TTCEvent]
    pairs: list[PreferencePair]
    stats: dict[str, Any]
    examples: list[UnpairedExample] | None = None


def gather_round(
    config, workflow: Workflow, model_dir: Path, round_index: int, times: PhaseTimes | None = None
) -> Collected:
    """One round of collection, in memory: events, pairs built with NAT's semantics, deduplicated
    and sampled (seeded), unpaired examples with an unpaired loss, and their statistics; the same
    on every process. `times` gets the phases "collection" and "pairs"."""
    c = config.collect
    times = times or PhaseTimes()
    with times.phase("collection"):
        events, runs = _collect_runs(config, workflow, model_dir, round_index)
    with times.phase("pairs"):
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
        examples, counts = None, {}
        if build.unpaired_loss(config):
            examples, counts = label_events(config, events, round_index)
    rewards = [p.metadata.get("reward", 0.0) for p in pairs] or [0.0]
    stats = {
        "round": round_index,
        "num_events": len(events),
        "num_pairs_built": len(result.pairs),
        "num_pairs": len(pairs),
        "avg_reward": float(np.mean(rewards)),
        "min_reward": float(np.min(rewards)),
        "max_reward": float(np.max(rewards)),
        **counts,
        "runs": runs,
    }
    return Collected(events, pairs, stats, examples)


def write_atomic(write, items, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(items, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_round(round_dir: Path, events, pairs, examples=None) -> None:
    """events.jsonl and pairs.jsonl of a round (and unpaired.jsonl, given `examples`), each whole
    or not at all (process 0 writes; every process returns once they are there)."""
    if is_main():
        _write_round_files(round_dir, events, pairs, examples)
    hosts.barrier(f"dpojax wrote {round_dir.name}")


def _write_round_files(round_dir: Path, events, pairs, examples) -> None:
    round_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(write_events, events, round_dir / "events.jsonl")
    write_atomic(
        lambda p, path: write_pairs(p, path, format="trl"), pairs, round_dir / "pairs.jsonl"
    )
    if examples is not None:
        write_atomic(write_unpaired, examples, round_dir / UNPAIRED_FILE)


def progress_line(run_number: int, run_id: str, entry: dict) -> dict[str, Any]:
    """A line of NAT's data_collection_progress.jsonl."""
    return {
        "run_number": run_number,
        "timestamp": datetime.now(UTC).isoformat(),
        "run_id": run_id,
        "num_trajectories": entry["num_events"],
        "num_dpo_pairs": entry["num_pairs"],
        "avg_reward": entry["avg_reward"],
        "min_reward": entry["min_reward"],
        "max_reward": entry["max_reward"],
    }


def collect(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Mode `collect`: one round of events and pairs with the current policy. SIGTERM / SIGINT
    abandon the collection (nothing but summary.json is written)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop:
        workflow = make_workflow(config)
        model_dir = initial_model(config, workdir)
        try:
            with stop.interruptible():
                events, pairs, stats, examples = gather_round(config, workflow, model_dir, 0)
        except Interrupted as e:
            stats = {"status": f"stopped by {e.signal_name}"}
        else:
            write_round(workdir, events, pairs, examples)
            if is_main():
                write_progress_files(workdir, [progress_line(1, "collect", stats)])
            stats = {"status": "completed", **stats}
        if is_main():
            atomic_write_text(workdir / "summary.json", json.dumps(stats, indent=2))
    hosts.barrier("dpojax collect done")
    return stats
