"""Runs a workflow's collection: `num_runs` runs, with NeMo Agent Toolkit's error policy."""

from __future__ import annotations

import logging
from typing import Any

from dpojax.collect.workflow import CandidateGenerator, Workflow
from dpojax.data.events import TTCEvent

log = logging.getLogger(__name__)


class CollectionError(RuntimeError):
    """Collection failed (and continue_on_collection_error is off, or nothing was collected)."""


def run_collection(
    workflow: Workflow,
    generate: CandidateGenerator,
    *,
    num_runs: int,
    round_index: int,
    seed: int,
    continue_on_collection_error: bool,
) -> tuple[list[TTCEvent], list[dict[str, Any]]]:
    """`num_runs` collection runs; returns all events and one record per run.

    As NAT's trainer does: a failing run is logged and skipped when
    `continue_on_collection_error`, and otherwise ends the collection ("Data collection failed at
    run r: e"); nothing collected at all is an error too ("No trajectories collected").
    """
    events: list[TTCEvent] = []
    runs: list[dict[str, Any]] = []
    for i in range(num_runs):
        run_id = f"round{round_index}_run{i}"
        try:
            run_events = workflow.collect(generate, run_id=run_id, seed=seed + 1000 * i)
        except Exception as e:
            runs.append({"run_id": run_id, "status": "failed", "error": f"{type(e).__name__}: {e}"})
            if not continue_on_collection_error:
                raise CollectionError(f"Data collection failed at run {i + 1}: {e}") from e
            log.warning("collection run %s failed (continuing): %s", run_id, e)
            continue
        events.extend(run_events)
        runs.append({"run_id": run_id, "status": "completed", "num_events": len(run_events)})
    if not events:
        raise CollectionError(f"No trajectories collected (round {round_index})")
    return events, runs
