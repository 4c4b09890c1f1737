"""The workflow protocol: how collection plugs into dpojax.

A workflow plays episodes on its dataset items. At each decision point it asks the candidate
generator for K candidate responses, scores them, emits one TTC event per candidate, and continues
the episode with one of them. dpojax turns the events into preference pairs (NAT semantics).

    class MyWorkflow:
        name = "my_workflow"

        def __init__(self, **kwargs): ...

        def collect(self, generate: CandidateGenerator, *, run_id: str, seed: int) -> list[TTCEvent]:
            prompts = [...]                                   # str or [{role, content}, ...]
            candidates = generate(prompts, k=8)               # K texts per prompt
            return [TTCEvent(example_id=..., turn_id=..., candidate_index=k, input=prompt,
                             output=text, score=my_score(text), name="dpo_candidate_move")
                    for ...]

        def evaluate(self, greedy: GreedyPolicy) -> dict[str, float]:   # optional
            ...

Plug it in with `--config.collect.workflow=package.module:MyWorkflow` and keyword arguments in
`--config.collect.workflow_kwargs='{"a": 1}'`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from dpojax.data.events import TTCEvent

log = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]]


class CandidateGenerator(Protocol):
    """K candidate response texts for each prompt (fewer when distinct ones run out)."""

    def __call__(self, prompts: Sequence[Prompt], k: int) -> list[list[str]]: ...


class GreedyPolicy(Protocol):
    """One greedy response text per prompt."""

    def __call__(self, prompts: Sequence[Prompt]) -> list[str]: ...


@runtime_checkable
class Workflow(Protocol):
    name: str

    def collect(
        self, generate: CandidateGenerator, *, run_id: str, seed: int
    ) -> list[TTCEvent]: ...


BUILTIN = {"tictactoe": "dpojax.collect.tictactoe_workflow:TicTacToeWorkflow"}


def load_workflow(spec: str, kwargs: Mapping[str, Any] | None = None) -> Workflow:
    """The workflow named `spec`: a built-in name or "package.module:ClassName"."""
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"collect.workflow {spec!r}: use a built-in name ({', '.join(BUILTIN)}) or "
            "'package.module:ClassName'"
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"collect.workflow {spec!r}: cannot import {module_name} ({e})") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"collect.workflow {spec!r}: {module_name} has no attribute {attr!r}")
    try:
        workflow = factory(**dict(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"collect.workflow {spec!r}: bad collect.workflow_kwargs ({e})") from None
    if not isinstance(workflow, Workflow):
        raise ValueError(
            f"collect.workflow {spec!r}: {attr} must have a `name` and a "
            "`collect(generate, *, run_id, seed)` method"
        )
    return workflow


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


class CollectionError(RuntimeError):
    """Collection failed (and continue_on_collection_error is off, or nothing was collected)."""


class RoundRank:
    """Orders rounds by `loop.best_metric` / `loop.best_mode`: one metric, or several separated by
    commas and compared in order (the next breaks ties), each with its own mode or one for all.
    E.g. `"losses_total,optimal_move_rate"` with `"min,max"`: the fewest lost games, then the best
    move rate. Calling it on a round's metrics gives a tuple that is larger for a better round, or
    None when a metric is missing."""

    def __init__(self, metrics: str, modes: str):
        self.keys = [k.strip() for k in metrics.split(",")]
        modes_list = [m.strip() for m in modes.split(",")]
        if len(modes_list) == 1:
            modes_list *= len(self.keys)
        if not all(self.keys) or len(modes_list) != len(self.keys):
            raise ValueError(
                f"loop.best_mode {modes!r} needs one mode, or one per metric of "
                f"loop.best_metric {metrics!r}"
            )
        if any(m not in ("min", "max") for m in modes_list):
            raise ValueError(f"loop.best_mode {modes!r}: each mode is 'min' or 'max'")
        self.signs = [1.0 if m == "max" else -1.0 for m in modes_list]

    def __call__(self, quality: dict[str, float]) -> tuple[float, ...] | None:
        if any(quality.get(k) is None for k in self.keys):
            return None
        return tuple(
            sign * float(quality[k]) for k, sign in zip(self.keys, self.signs, strict=True)
        )
