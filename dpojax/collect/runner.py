"""Runs a workflow's collection: `num_runs` runs, with NeMo Agent Toolkit's error policy.

`run_collection` runs them one after another in this process. A multi-process `loop` runs them
spread over the processes instead: `run_one` for the runs of this process, then `gather_runs`
over every run's result in run order (`dpojax.jobs.rounds.collection`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dpojax.collect.workflow import CandidateGenerator, Workflow
from dpojax.data.events import TTCEvent

log = logging.getLogger(__name__)

# Workflow seed of run i: the round's seed + RUN_SEED_STRIDE * i.
RUN_SEED_STRIDE = 1000


class CollectionError(RuntimeError):
    """Collection failed (and continue_on_collection_error is off, or nothing was collected)."""


def run_one(
    workflow: Workflow,
    generate: CandidateGenerator,
    *,
    run_index: int,
    round_index: int,
    seed: int,
) -> tuple[list[TTCEvent], dict[str, Any]]:
    """Collection run `run_index` of a round: (events, record). A failing run gives no events and
    a record with status "failed" and the error (the exception itself under "exception")."""
    run_id = f"round{round_index}_run{run_index}"
    try:
        events = workflow.collect(generate, run_id=run_id, seed=seed + RUN_SEED_STRIDE * run_index)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        return [], {"run_id": run_id, "status": "failed", "error": error, "exception": e}
    return events, {"run_id": run_id, "status": "completed", "num_events": len(events)}


def gather_runs(
    results: Sequence[tuple[list[TTCEvent], dict[str, Any]]],
    *,
    round_index: int,
    continue_on_collection_error: bool,
) -> tuple[list[TTCEvent], list[dict[str, Any]]]:
    """All events and one record per run from the runs' results in run order, as NAT's trainer
    does: a failing run is logged and skipped when `continue_on_collection_error`, and otherwise
    ends the collection ("Data collection failed at run r: e"); nothing collected at all is an
    error too ("No trajectories collected")."""
    events: list[TTCEvent] = []
    runs: list[dict[str, Any]] = []
    for i, (run_events, record) in enumerate(results):
        cause = record.get("exception")
        runs.append({k: v for k, v in record.items() if k != "exception"})
        if record["status"] == "failed":
            message = record["error"].split(": ", 1)[-1]  # the exception's own text
            if not continue_on_collection_error:
                raise CollectionError(
                    f"Data collection failed at run {i + 1}: {message}"
                ) from cause
            log.warning("collection run %s failed (continuing): %s", record["run_id"], message)
            continue
        events.extend(run_events)
    if not events:
        raise CollectionError(f"No trajectories collected (round {round_index})")
    return events, runs


def run_collection(
    workflow: Workflow,
    generate: CandidateGenerator,
    *,
    num_runs: int,
    round_index: int,
    seed: int,
    continue_on_collection_error: bool,
) -> tuple[list[TTCEvent], list[dict[str, Any]]]:
    """`num_runs` collection runs in this process; returns all events and one record per run
    (NAT's error policy: `gather_runs`; a failure that ends the collection stops at that run)."""
    results = []
    for i in range(num_runs):
        results.append(run_one(workflow, generate, run_index=i, round_index=round_index, seed=seed))
        if results[-1][1]["status"] == "failed" and not continue_on_collection_error:
            break
    return gather_runs(
        results, round_index=round_index, continue_on_collection_error=continue_on_collection_error
    )
