"""Unpaired examples (KTO, BCO): a prompt, one completion and a label (desirable or not).

Three ways in:

- **TRL unpaired records** (`read_unpaired`): `prompt`, `completion` and `label` (a boolean, true
  for desirable, or 1 / 0), plain text or conversational (`{role, content}` messages; a plain prompt next to a
  conversational completion becomes one user message), with per-record `tools` and
  `chat_template_kwargs` as pairs have them. The same sources as pairs (`dpojax.data.sources`:
  files, folders, Hub dataset ids, splits, subsets, streaming), a column mapping
  (`UNPAIRED_COLUMN_KEYS` -> the dataset's names) and a system prompt; bad records are skipped
  and reported as `file:line: reason` (or raise with `strict=True`) as pairs are.
- **preference pairs** (`unpair`): every pair gives its chosen completion (desirable) and its
  rejected one (undesirable), in TRL's `unpair_preference_dataset` order (per run of 1,000
  pairs: every chosen, then every rejected).
- **TTC events** (`build_unpaired`): a decision point is a turn (`example_id`, `turn_id`), split
  by input as the pair builder does (candidates of one decision point share their prompt). With
  `threshold`, every candidate scoring `>= threshold` is desirable and every other one
  undesirable, so single-candidate turns count. With `top_k`, a decision point's candidates are
  ranked by score (stable, best first): the first k are desirable, and the last k of the others
  are undesirable, except those tied with the lowest desirable score (left out); a
  single-candidate decision point has no ranking and is left out (counted).

Dedup (`dedup_unpaired`, applied by `build_unpaired`): examples with the same prompt, completion,
`tools` and `chat_template_kwargs` are one example; the first occurrence is kept, with its
metadata. When the copies disagree on the label, the evidence contradicts itself and every copy
is dropped (counted in `conflicting`).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpojax.data.events import DEFAULT_TTC_STEP_NAME, TTCEvent
from dpojax.data.pair_files import iter_records
from dpojax.data.pairs import PreferencePair
from dpojax.data.problems import (
    MISSING_FIELD,
    BadRecord,
    ReadSummary,
)
from dpojax.data.records import (
    Completion,
    Prompt,
    as_chat,
    as_metadata,
    copy_prompt,
    jsonl_text,
    wrong_type,
)
from dpojax.data.shapes import completion_field, json_field, plain_turn, with_system_prompt
from dpojax.data.sources import open_source

UNPAIRED_COLUMN_KEYS = ("prompt", "completion", "label", "tools", "chat_template_kwargs")
UNPAIR_CHUNK = 1000
"""Rows per batch of TRL's `unpair_preference_dataset` (`datasets.map`'s default batch size)."""


@dataclass(slots=True)
class UnpairedExample:
    """A prompt (string or messages), one completion (string or chat messages) and its label
    (True: desirable). `tools` and `chat_kwargs` as in `PreferencePair`. Examples from
    `build_unpaired` carry `example_id`, `turn_id`, `candidate_index`, `score`, `num_candidates`
    and `raw_metadata` (the event's own) in `metadata`."""

    prompt: Prompt
    completion: Completion
    label: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    chat_kwargs: dict[str, Any] | None = None

    @property
    def conversational(self) -> bool:
        return not (isinstance(self.prompt, str) and isinstance(self.completion, str))

    def to_dict(self) -> dict[str, Any]:
        """TRL's unpaired record (with `metadata`)."""
        out = {
            "prompt": copy_prompt(self.prompt),
            "completion": copy_prompt(self.completion),
            "label": self.label,
            "metadata": dict(self.metadata),
        }
        if self.tools is not None:
            out["tools"] = self.tools
        if self.chat_kwargs is not None:
            out["chat_template_kwargs"] = dict(self.chat_kwargs)
        return out


# ----------------------------------------------------------------------------- records


def unpaired_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """Every name of `UNPAIRED_COLUMN_KEYS` -> the dataset's column name (mapped or its own)."""
    columns = {k: v for k, v in (columns or {}).items() if v}
    unknown = sorted(set(columns) - set(UNPAIRED_COLUMN_KEYS))
    if unknown:
        known = ", ".join(UNPAIRED_COLUMN_KEYS)
        raise ValueError(f"unknown unpaired column names {unknown}; known: {known}")
    return {key: columns.get(key, key) for key in UNPAIRED_COLUMN_KEYS}


def _missing(obj: Mapping[str, Any], name: str) -> BadRecord:
    hint = "an unpaired record has 'prompt', 'completion' and 'label'"
    if name != "prompt" and "chosen" in obj and "rejected" in obj:
        hint += "; this one looks like a preference pair (read it with read_pairs, then unpair)"
    return BadRecord(MISSING_FIELD, f"missing field '{name}' ({hint})")


def _label(value: Any, key: str) -> bool:
    """A boolean, or 1 / 0 (an integer column): TRL reads the label as a boolean."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise wrong_type(key, "true (desirable) or false (undesirable)", value)


def unpaired_from_record(
    obj: Mapping[str, Any], columns: Mapping[str, str] | None = None, system_prompt: str = ""
) -> UnpairedExample:
    """One TRL unpaired record (module docstring) as an example; `BadRecord` on the first
    problem. `columns` maps `UNPAIRED_COLUMN_KEYS` to the record's names."""
    names = unpaired_columns(columns)
    for key in ("prompt", "completion", "label"):
        if names[key] not in obj:
            raise _missing(obj, names[key])
    completion = completion_field(obj[names["completion"]], names["completion"])
    label = _label(obj[names["label"]], names["label"])
    prompt = obj[names["prompt"]]
    if isinstance(prompt, list):
        prompt = as_chat(prompt, names["prompt"], allow_empty=True)
    elif not isinstance(prompt, str):
        raise wrong_type(names["prompt"], "a string or a list of messages", prompt)
    elif isinstance(completion, list):
        prompt = [{"role": "user", "content": prompt}]
    tools = json_field(obj.get(names["tools"]), names["tools"], list)
    chat_kwargs = json_field(
        obj.get(names["chat_template_kwargs"]), names["chat_template_kwargs"], dict
    )
    return UnpairedExample(
        with_system_prompt(prompt, system_prompt),
        plain_turn(completion),
        label,
        dict(as_metadata(obj.get("metadata")) or {}),
        tools=tools,
        chat_kwargs=chat_kwargs,
    )


def iter_unpaired(
    path: str | Path,
    summary: ReadSummary,
    *,
    split: str | None = None,
    subset: str | None = None,
    columns: Mapping[str, str] | None = None,
    system_prompt: str = "",
    streaming: bool = False,
) -> Iterator[tuple[int, UnpairedExample]]:
    """`(position, example)` for every good record of a source, as `iter_pairs` reads pairs: the
    bad records go to `summary` once the source is exhausted. Call `summary.finish(strict)`."""
    unpaired_columns(columns)  # a bad mapping fails before any reading
    yield from iter_records(
        path,
        summary,
        lambda obj: unpaired_from_record(obj, columns, system_prompt),
        split=split,
        subset=subset,
        streaming=streaming,
    )


def read_unpaired(
    path: str | Path,
    *,
    split: str | None = None,
    strict: bool = False,
    subset: str | None = None,
    columns: Mapping[str, str] | None = None,
    system_prompt: str = "",
    streaming: bool = False,
) -> tuple[list[UnpairedExample], ReadSummary]:
    """Read TRL unpaired records from a file, a folder or a Hub dataset; return
    `(examples, summary)`. Bad records are skipped and counted (logged once); `strict=True`
    raises `DataError` listing each as `file:line: reason`."""
    summary = ReadSummary(str(path))
    examples = [
        example
        for _, example in iter_unpaired(
            path,
            summary,
            split=split,
            subset=subset,
            columns=columns,
            system_prompt=system_prompt,
            streaming=streaming,
        )
    ]
    return examples, summary.finish(strict)


def write_unpaired(examples: Sequence[UnpairedExample], path: str | Path) -> Path:
    """One JSONL file of TRL unpaired records (`UnpairedExample.to_dict`, with `metadata`): UTF-8,
    one record per line and a final newline; `read_unpaired` reads it back."""
    path = Path(path)
    path.write_text(jsonl_text(e.to_dict() for e in examples), encoding="utf-8")
    return path


def holds_pairs(
    path: str | Path,
    *,
    split: str | None = None,
    subset: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> bool:
    """Whether the source's first record has no label column (it is then read as preference
    pairs and unpaired, as TRL's `KTOTrainer` unpairs a paired dataset). Reads one record."""
    label = unpaired_columns(columns)["label"]
    source = open_source(path, ReadSummary(str(path)), split=split, subset=subset)
    for _, obj in source.records:
        return isinstance(obj, dict) and label not in obj
    return False


def unpair(pairs: Sequence[PreferencePair]) -> list[UnpairedExample]:
    """Each pair's chosen (desirable) and rejected (undesirable) completion, in TRL's order."""
    out: list[UnpairedExample] = []
    for start in range(0, len(pairs), UNPAIR_CHUNK):
        chunk = pairs[start : start + UNPAIR_CHUNK]
        for label in (True, False):
            out.extend(
                UnpairedExample(
                    copy_prompt(p.prompt),
                    copy_prompt(p.chosen if label else p.rejected),
                    label,
                    dict(p.metadata),
                    tools=p.tools,
                    chat_kwargs=p.chat_kwargs,
                )
                for p in chunk
            )
    return out


# ----------------------------------------------------------------------------- dedup


def _part_key(part: Prompt | Completion | None) -> Hashable:
    if part is None or isinstance(part, str):
        return part
    return json.dumps(part, sort_keys=True, default=str)


def example_key(example: UnpairedExample) -> Hashable:
    """What makes two examples the same: prompt, completion, `tools` and `chat_kwargs`."""
    return (
        _part_key(example.prompt),
        _part_key(example.completion),
        _part_key(example.tools),
        _part_key(example.chat_kwargs),
    )


def dedup_unpaired(
    examples: Iterable[UnpairedExample],
) -> tuple[list[UnpairedExample], int, int]:
    """`(kept, duplicates, conflicting)`: the first occurrence of each example, in order, less
    the examples whose copies disagree on the label (all their copies dropped); `duplicates`
    counts the dropped copies that agreed, `conflicting` the examples dropped for disagreeing."""
    first: dict[Hashable, UnpairedExample] = {}
    labels: dict[Hashable, set[bool]] = {}
    duplicates = 0
    for example in examples:
        key = example_key(example)
        if key in first:
            duplicates += example.label in labels[key]
            labels[key].add(example.label)
        else:
            first[key] = example
            labels[key] = {example.label}
    conflicting = sum(len(seen) > 1 for seen in labels.values())
    kept = [e for key, e in first.items() if len(labels[key]) == 1]
    return kept, duplicates, conflicting


# ----------------------------------------------------------------------------- TTC events


@dataclass(slots=True)
class UnpairedStats:
    """Counters of `build_unpaired`. `decision_points`: turns (split by input), of which
    `single_candidate` had one candidate and `mixed_input_turns` turns answered several inputs;
    `unlabelled`: candidates given no label (top-k mode: the middle, ties, single candidates);
    `duplicates` and `conflicting` as `dedup_unpaired` counts them; `desirable` and
    `undesirable`: the examples returned."""

    total_candidates: int = 0
    decision_points: int = 0
    single_candidate: int = 0
    mixed_input_turns: int = 0
    unlabelled: int = 0
    duplicates: int = 0
    conflicting: int = 0
    desirable: int = 0
    undesirable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.desirable} desirable and {self.undesirable} undesirable examples from "
            f"{self.total_candidates} candidates at {self.decision_points} decision points "
            f"({self.single_candidate} with one candidate; left out: {self.unlabelled} "
            f"unlabelled, {self.duplicates} duplicates, {self.conflicting} with both labels)"
        )


@dataclass(slots=True)
class UnpairedBuildResult:
    examples: list[UnpairedExample]
    stats: UnpairedStats


def _decision_points(events: Iterable[TTCEvent], name: str, stats: UnpairedStats) -> list[list]:
    """The candidates of each decision point, in first-appearance order."""
    turns: dict[str, dict[Hashable, list[TTCEvent]]] = {}
    for event in events:
        if event.name != name:
            continue
        stats.total_candidates += 1
        by_input = turns.setdefault(f"{event.example_id}::{event.turn_id}", {})
        by_input.setdefault(_part_key(event.input), []).append(event)
    stats.mixed_input_turns = sum(len(by_input) > 1 for by_input in turns.values())
    return [group for by_input in turns.values() for group in by_input.values()]


def _top_k_labels(candidates: list[TTCEvent], k: int) -> list[bool | None]:
    """Per candidate (in its order): True (top k), False (bottom k of the rest, below every
    desirable score) or None."""
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].score, reverse=True)
    labels: list[bool | None] = [None] * len(candidates)
    if len(candidates) < 2:
        return labels
    top, rest = order[:k], order[k:]
    floor = min(candidates[i].score for i in top)
    for i in top:
        labels[i] = True
    for i in rest[-k:]:
        if candidates[i].score < floor:
            labels[i] = False
    return labels


def _example(event: TTCEvent, label: bool, num_candidates: int) -> UnpairedExample:
    metadata = {
        "example_id": event.example_id,
        "turn_id": event.turn_id,
        "candidate_index": event.candidate_index,
        "score": event.score,
        "num_candidates": num_candidates,
        "raw_metadata": dict(event.metadata or {}),
    }
    return UnpairedExample(copy_prompt(event.input), event.output, label, metadata)


def build_unpaired(
    events: Iterable[TTCEvent],
    *,
    threshold: float | None = None,
    top_k: int | None = None,
    ttc_step_name: str = DEFAULT_TTC_STEP_NAME,
) -> UnpairedBuildResult:
    """Unpaired examples from TTC events by `threshold` or `top_k` (exactly one; module
    docstring), deduplicated, in the events' order; with the counts per label in `.stats`."""
    if (threshold is None) == (top_k is None):
        raise ValueError("give exactly one of threshold (a score) and top_k (a count)")
    if top_k is not None and (isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    stats = UnpairedStats()
    points = _decision_points(events, ttc_step_name, stats)
    stats.decision_points = len(points)
    found: list[UnpairedExample] = []
    for candidates in points:
        stats.single_candidate += len(candidates) == 1
        if top_k is None:
            labels = [c.score >= threshold for c in candidates]
        else:
            labels = _top_k_labels(candidates, top_k)
        for candidate, label in zip(candidates, labels, strict=True):
            if label is None:
                stats.unlabelled += 1
            else:
                found.append(_example(candidate, label, len(candidates)))
    examples, stats.duplicates, stats.conflicting = dedup_unpaired(found)
    stats.desirable = sum(e.label for e in examples)
    stats.undesirable = len(examples) - stats.desirable
    return UnpairedBuildResult(examples, stats)
