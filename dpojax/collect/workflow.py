"""The workflow protocol: how collection plugs into dpojax.

A workflow plays episodes on its dataset items. At each decision point it asks the candidate
generator for K candidate responses, scores them, emits one TTC event per candidate, and continues
the episode with one of them. dpojax turns the events into preference pairs (NAT semantics,
docs/data.md#building-pairs).

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

Use it with `--config.collect.workflow=package.module:MyWorkflow` and keyword arguments in
`--config.collect.workflow_kwargs='{"a": 1}'`, or register it under a name: a package declares
an entry point in the `dpojax.workflows` group (`name = "package.module:MyWorkflow"`), as dpojax
declares its built-in recipes. Optional class attributes:

- typed options: when the workflow class is a dataclass whose fields are declared with
  `dpojax.schema.setting` (default, doc, choices), each field is a config key
  `collect.<name>.<field>`, checked at start-up; `option_problems(options)` (a static method)
  reports further problems as (field, problem) pairs;
- `headline_metrics`: the evaluation metrics that summaries, tables and reports show first;
- `metric_labels`: metric name -> what it is in words, for tables (`{name}` fields take the
  evaluation's values: "games lost of {games_vs_random}").
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from dpojax.data.events import TTCEvent
from dpojax.data.records import Prompt
from dpojax.schema import Key, keys

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dpojax.workflows"
# dpojax's own workflows: known without the package's entry points, so a source checkout that was
# not pip-installed (PYTHONPATH=.) still has them (they are also registered in pyproject.toml)
BUILTIN_WORKFLOWS = {"tictactoe": "dpojax.workflows.tictactoe.workflow:TicTacToeWorkflow"}


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


def registered_workflows() -> dict[str, str]:
    """Registered workflow names -> "package.module:ClassName": dpojax's own, then the entry
    points of the `dpojax.workflows` group from every installed package."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**BUILTIN_WORKFLOWS, **found}


def _import_target(spec: str, target: str) -> Any:
    if ":" not in target:
        names = ", ".join(sorted(registered_workflows())) or "none"
        raise ValueError(
            f"collect.workflow {spec!r}: use a registered name ({names}) or "
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
    return factory


def workflow_class(spec: str) -> Any:
    """The class (or factory) named by `spec`: a registered name or "package.module:ClassName"."""
    return _import_target(spec, registered_workflows().get(spec, spec))


def option_keys(factory: Any) -> list[Key]:
    """The typed options of a workflow class (its dataclass fields); [] for other factories."""
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return list(keys(factory))
    return []


def option_problems(factory: Any, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, problem) pairs from the workflow's own `option_problems`, if it has one."""
    check = getattr(factory, "option_problems", None)
    return list(check(options)) if callable(check) else []


def load_workflow(spec: str, kwargs: Mapping[str, Any] | None = None) -> Workflow:
    """The workflow named `spec` (a registered name or "package.module:ClassName"), built with
    `kwargs`."""
    factory = workflow_class(spec)
    try:
        workflow = factory(**dict(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"collect.workflow {spec!r}: bad collect.workflow_kwargs ({e})") from None
    if not isinstance(workflow, Workflow):
        raise ValueError(
            f"collect.workflow {spec!r}: {factory!r} must have a `name` and a "
            "`collect(generate, *, run_id, seed)` method"
        )
    return workflow


def headline_metrics(workflow: Any, quality: Mapping[str, float]) -> list[str]:
    """The workflow's `headline_metrics` present in `quality`, in order; without the attribute,
    every metric of `quality` in its order."""
    declared = getattr(workflow, "headline_metrics", None)
    if declared is None:
        return list(quality)
    return [k for k in declared if k in quality]


def metric_labels(workflow: Any, quality: Mapping[str, Any]) -> dict[str, str]:
    """The workflow's `metric_labels` of the metrics in `quality`, their `{name}` fields filled
    from `quality` (a field it lacks leaves the label as declared); {} without the attribute."""
    out = {}
    for name, label in (getattr(workflow, "metric_labels", None) or {}).items():
        if name in quality:
            try:
                out[name] = label.format_map(quality)
            except (KeyError, ValueError, IndexError):
                out[name] = label
    return out


# loop.reference: the reference of every round is the initial model, or the round's own
# starting policy.
LOOP_REFERENCES = ("initial", "previous")


class RoundRank:
    """Orders rounds by `loop.best_metric` / `loop.best_mode`: one metric, or several separated by
    commas and compared in order (the next breaks ties), each with its own mode or one for all.
    E.g. `"losses_total,optimal_move_rate"` with `"min,max"`: the fewest lost games, then the best
    move rate. Calling it on a round's metrics gives a tuple that is larger for a better round, or
    None when a metric is missing. No metric (`""`) ranks no round (the command line refuses it
    in mode loop)."""

    def __init__(self, metrics: str, modes: str):
        self.keys = [k.strip() for k in metrics.split(",")] if metrics.strip() else []
        modes_list = [m.strip() for m in modes.split(",")]
        if len(modes_list) == 1 or not self.keys:
            modes_list *= len(self.keys)
        if not all(self.keys) or len(modes_list) != len(self.keys):
            raise ValueError(
                f"loop.best_mode {modes!r} needs one mode, or one per metric of "
                f"loop.best_metric {metrics!r}"
            )
        if any(m not in ("min", "max") for m in modes_list):
            raise ValueError(f"loop.best_mode {modes!r}: each mode is 'min' or 'max'")
        self.signs = [1.0 if m == "max" else -1.0 for m in modes_list]

    def __call__(self, quality: Mapping[str, float]) -> tuple[float, ...] | None:
        if not self.keys or any(quality.get(k) is None for k in self.keys):
            return None
        return tuple(
            sign * float(quality[k]) for k, sign in zip(self.keys, self.signs, strict=True)
        )
