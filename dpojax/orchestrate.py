"""Collection runs -> pairs -> training, round after round (iterative on-policy DPO).

Mode `collect`: one round of collection; writes events and pairs. Mode `loop`: `loop.rounds`
rounds of collect -> train -> evaluate, with the reference fixed at the initial model or reset to
each round's starting policy; the best policy by the workflow's evaluation is exported to
WORKDIR/export. Progress files follow NeMo Agent Toolkit's (`data_collection_progress.jsonl`,
`collection_history.json`, `final_metrics.json`), plus `summary.json` and `report.md`.
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

import ml_collections
import numpy as np

from dpojax.collect.policy import ModelPolicy
from dpojax.collect.workflow import RoundRank, load_workflow, run_collection
from dpojax.data.events import write_events
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import build_pairs, dedup_pairs, sample_pairs
from dpojax.models import from_pretrained

log = logging.getLogger(__name__)

QUALITY_KEYS = (
    "optimal_move_rate",
    "optimal_move_rate_nontrivial",
    "illegal_move_rate",
    "losses_vs_random",
    "losses_vs_perfect_as_x",
    "losses_vs_perfect_as_o",
)


def make_workflow(config: ml_collections.ConfigDict):
    c = config.collect
    kwargs = json.loads(c.workflow_kwargs or "{}")
    if c.workflow == "tictactoe":
        kwargs = {**c.tictactoe.to_dict(), **kwargs}
    return load_workflow(c.workflow, kwargs)


def initial_model(config: ml_collections.ConfigDict, workdir: Path) -> Path:
    """model.path, or a fresh random tiny model (loop.init_tiny_model) created in the workdir."""
    if config.model.path:
        return Path(config.model.path)
    from dpojax.models.tiny import make_tiny_checkpoint

    path = workdir / "initial_model"
    if not (path / "config.json").is_file():
        overrides = json.loads(config.loop.init_model_overrides or "{}")
        make_tiny_checkpoint(
            path, config.loop.init_tiny_model, seed=config.loop.init_seed, **overrides
        )
    return path


def _policy(config: ml_collections.ConfigDict, model_dir: Path, seed: int) -> ModelPolicy:
    model, tokenizer = from_pretrained(model_dir, config.model.dtype)
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


def evaluate_policy(config, workflow, model_dir: Path) -> dict[str, float]:
    if not hasattr(workflow, "evaluate"):
        return {}
    policy = _policy(config, model_dir, config.seed)
    return {k: float(v) for k, v in workflow.evaluate(policy.greedy).items()}


def collect_round(config, workflow, model_dir: Path, round_dir: Path, round_index: int):
    """One round of collection: events, pairs (NAT semantics, dedup, seeded sampling), files."""
    c = config.collect
    policy = _policy(config, model_dir, config.seed + round_index)
    events, runs = run_collection(
        workflow,
        policy.candidates,
        num_runs=c.num_runs,
        round_index=round_index,
        seed=config.seed * 7919 + round_index,
        continue_on_collection_error=c.continue_on_collection_error,
    )
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
    (workdir / "summary.json").write_text(json.dumps(stats, indent=2))
    return stats


def loop(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
    """Mode `loop`: rounds of collect -> train -> evaluate; keeps and exports the best policy."""
    from dpojax.train import loop as train_loop

    start = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    workflow = make_workflow(config)
    initial = initial_model(config, workdir)
    rank = RoundRank(config.loop.best_metric, config.loop.best_mode)
    key = rank.keys[0]
    initial_quality = evaluate_policy(config, workflow, initial)
    log.info("round 0 (initial): %s", _brief(initial_quality))
    rounds = [{"round": 0, "model": str(initial), **initial_quality}]
    best = (rank(initial_quality), 0, initial)
    current, history, per_round = initial, [], []
    stop_reason, round_start, last_round = None, time.perf_counter(), 0.0
    for r in range(1, config.loop.rounds + 1):
        budget = config.loop.max_wall_seconds
        elapsed = round_start - start
        if budget and r > 1 and elapsed + last_round > budget:
            stop_reason = "max_wall_seconds"
            log.info(
                "stopping after round %d: %.0f s elapsed, and a round of %.0f s more would pass "
                "loop.max_wall_seconds=%g",
                r - 1,
                elapsed,
                last_round,
                budget,
            )
            break
        round_dir = workdir / f"round_{r:02d}"
        pairs, stats = collect_round(config, workflow, current, round_dir, r)
        _progress_files(workdir, f"round_{r:02d}", history, stats)
        if not pairs:
            log.warning("round %d: no pairs (all candidates scored alike); stopping", r)
            stop_reason = "no pairs"
            break
        per_round.append(pairs)
        train_pairs = _training_pairs(config, per_round, r)
        write_pairs(train_pairs, round_dir / "train_pairs.jsonl", format="trl")
        reference = initial if config.loop.reference == "initial" else current
        train_cfg = _train_config(config, current, reference, round_dir / "train_pairs.jsonl")
        summary = train_loop.train(train_cfg, round_dir / "train")
        current = round_dir / "train" / "export"
        quality = evaluate_policy(config, workflow, current)
        log.info("round %d: %d pairs, %s", r, stats["num_pairs"], _brief(quality))
        rounds.append(
            {
                "round": r,
                "model": str(current),
                "num_pairs": stats["num_pairs"],
                "train_loss": (summary.get("final_eval") or {}).get("loss"),
                **quality,
            }
        )
        value = rank(quality)
        if value is not None and (best[0] is None or value > best[0]):
            best = (value, r, current)
        now = time.perf_counter()
        round_start, last_round = now, now - round_start
    _, best_round, best_dir = best
    if (workdir / "export").exists():
        shutil.rmtree(workdir / "export")
    shutil.copytree(best_dir, workdir / "export")
    final = next(x for x in rounds if x["round"] == best_round)
    out = {
        "initial": {k: initial_quality.get(k) for k in QUALITY_KEYS if k in initial_quality}
        | {k: v for k, v in initial_quality.items() if k not in QUALITY_KEYS},
        "final": {k: final.get(k) for k in QUALITY_KEYS if k in final}
        | {k: v for k, v in final.items() if k not in QUALITY_KEYS},
        "best_round": best_round,
        "rounds": rounds,
        "stop_reason": stop_reason,
        "wall_seconds": time.perf_counter() - start,
    }
    (workdir / "summary.json").write_text(json.dumps(out, indent=2, default=str))
    (workdir / "final_metrics.json").write_text(
        json.dumps(
            {
                "run_id": workdir.name,
                "timestamp": datetime.now(UTC).isoformat(),
                "status": "completed",
                "message": f"{len(rounds) - 1} rounds; best round {best_round}",
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
            },
            indent=2,
        )
    )
    _report(workdir, out, key)
    _print_table(out)
    return out


def _brief(quality: dict[str, float]) -> str:
    return ", ".join(f"{k} {quality[k]:.3f}" for k in QUALITY_KEYS[:3] if k in quality)


def _print_table(out: dict[str, Any]) -> None:
    keys = [k for k in QUALITY_KEYS if k in out["initial"]]
    if not keys:
        return
    width = max(len(k) for k in keys)
    print(f"\n{'metric':<{width}}  {'initial':>9}  {'final':>9}")
    for k in keys:
        print(f"{k:<{width}}  {out['initial'][k]:>9.3f}  {out['final'][k]:>9.3f}")
    print(f"best round {out['best_round']}, {out['wall_seconds']:.0f} s wall\n")


def _report(workdir: Path, out: dict[str, Any], key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = out["rounds"]
    plots = workdir / "plots"
    plots.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lines = []
    for name in dict.fromkeys(
        (key, "optimal_move_rate", "optimal_move_rate_nontrivial", "illegal_move_rate")
    ):
        values = [r.get(name) for r in rounds]
        if all(v is None for v in values):
            continue
        rate = all(v is None or 0 <= v <= 1 for v in values)
        if not rate:  # e.g. a count of lost games: its own axis on the right
            counts = ax.twinx()
            counts.set_ylabel(name)
        lines += (ax if rate else counts).plot(
            [r["round"] for r in rounds], values, marker="o" if rate else "x", label=name
        )
    ax.set_xlabel("round")
    ax.set_ylabel("rate")
    ax.set_title("Policy quality per round")
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(lines, [line.get_label() for line in lines])
    fig.tight_layout()
    fig.savefig(plots / "quality_per_round.png", dpi=110)
    plt.close(fig)
    keys = [k for k in QUALITY_KEYS if k in out["initial"]]
    lines = ["# dpojax iterative DPO run", "", "| metric | initial | final |", "|---|---|---|"]
    lines += [f"| {k} | {out['initial'][k]:.4f} | {out['final'][k]:.4f} |" for k in keys]
    lines += [
        "",
        f"Best round: {out['best_round']}; wall time {out['wall_seconds']:.0f} s.",
        "",
        "![quality per round](plots/quality_per_round.png)",
        "",
        "| round | pairs | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {r.get('num_pairs', '-')} | "
            + " | ".join(f"{r.get(k, float('nan')):.3f}" for k in keys)
            + " |"
        )
    (workdir / "report.md").write_text("\n".join(lines) + "\n")
