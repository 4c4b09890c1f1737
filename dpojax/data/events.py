"""TTC events: one scored candidate of one decision point (turn), as JSONL.

A TTC event has the meaning of NeMo Agent Toolkit's `TTCEventData` carried by a `TTC_END` step:
`example_id` (the eval item), `turn_id` (the decision point), `candidate_index`, the candidate's
`input` (prompt: string or `{role, content}` messages) and `output` (completion text), its `score`
(higher is better) and the step `name` the pair builder filters on.

JSONL form, one object per line. Required keys: `example_id` (string or integer), `turn_id` (string
or integer), `input`, `output` (non-empty string), `score` (finite number). Optional: `turn_index`
(integer or null, default null), `candidate_index` (integer, null or absent means 0, as in NAT),
`name` (default `"dpo_candidate_move"`), `metadata` (object or null). Unknown keys are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpojax.data.problems import BadRecord, Problem, ReadSummary, iter_jsonl
from dpojax.data.records import (
    Prompt,
    as_completion,
    as_id,
    as_int,
    as_metadata,
    as_prompt,
    as_score,
    as_str,
    get_field,
    jsonl_text,
)

DEFAULT_TTC_STEP_NAME = "dpo_candidate_move"


@dataclass(slots=True, kw_only=True)
class TTCEvent:
    """One scored candidate. See the module docstring for the field meanings."""

    example_id: str
    turn_id: str
    turn_index: int | None = None
    candidate_index: int = 0
    input: Prompt
    output: str
    score: float
    name: str = DEFAULT_TTC_STEP_NAME
    metadata: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSONL object (`metadata` omitted when None)."""
        out = {
            "example_id": self.example_id,
            "turn_id": self.turn_id,
            "turn_index": self.turn_index,
            "candidate_index": self.candidate_index,
            "input": self.input,
            "output": self.output,
            "score": self.score,
            "name": self.name,
        }
        if self.metadata is not None:
            out["metadata"] = self.metadata
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> TTCEvent:
        """Validate one JSONL object; raises `BadRecord` (code + reason) on the first problem."""
        candidate_index = obj.get("candidate_index")
        return cls(
            example_id=as_id(get_field(obj, "example_id"), "example_id"),
            turn_id=as_id(get_field(obj, "turn_id"), "turn_id"),
            turn_index=as_int(obj.get("turn_index"), "turn_index", allow_none=True),
            candidate_index=as_int(candidate_index, "candidate_index", allow_none=True) or 0,
            input=as_prompt(get_field(obj, "input"), "input"),
            output=as_completion(get_field(obj, "output"), "output"),
            score=as_score(get_field(obj, "score"), "score"),
            name=as_str(obj.get("name", DEFAULT_TTC_STEP_NAME), "name"),
            metadata=as_metadata(obj.get("metadata")),
        )


def read_events(path: str | Path, *, strict: bool = False) -> tuple[list[TTCEvent], ReadSummary]:
    """Read TTC events from JSONL.

    Returns `(events, summary)`. Bad lines (not UTF-8, malformed JSON, missing or mistyped fields,
    non-finite scores, empty outputs) are skipped and counted in `summary`, which is logged once;
    with `strict=True` a `DataError` listing every problem as `file:line: reason` is raised instead.
    """
    summary = ReadSummary(str(path))
    events: list[TTCEvent] = []
    for line, obj in iter_jsonl(path, summary):
        try:
            events.append(TTCEvent.from_dict(obj))
        except BadRecord as bad:
            summary.add(Problem(str(path), line, bad.code, bad.reason))
    summary.kept = len(events)
    return events, summary.finish(strict)


def write_events(events: Iterable[TTCEvent], path: str | Path) -> Path:
    """Write events as UTF-8 JSONL (one object per line, trailing newline). Returns the path.

    Raises `ValueError` for a non-finite score (JSON has no NaN).
    """
    path = Path(path)
    path.write_text(jsonl_text(e.to_dict() for e in events), encoding="utf-8")
    return path
