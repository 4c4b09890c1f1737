"""Import TTC events from a NeMo Agent Toolkit (NAT) evaluation output.

Accepted layouts (one JSON document):
- `workflow_output.json`: a list of eval items, each with `id` and `intermediate_steps`;
- a dumped `EvaluationRunOutput` (`{"eval_input": {"eval_input_items": [...]}}`) or
  `{"eval_input_items": [...]}`, whose items carry their steps in `trajectory`.

Each step is a dumped `IntermediateStep` (`{"parent_id", "function_ancestry", "payload": {...}}`); a
bare payload is accepted too. Only `TTC_END` steps become events, read with the rules of NAT 1.9's
DPO trajectory builder: items in list order, duplicate item ids collapse to the last item (at the
position of the first), a step without data / `turn_id` / `score` is skipped, `candidate_index` null
means 0, the input becomes `""` (null), the string, a message list, or otherwise its Python `str()`,
the output is `str(output)` when truthy, and the payload metadata (or `{}`) becomes the event
metadata.

Beyond NAT, bad steps are reported as `file:line: reason` and counted (see `problems.py`), and steps
whose score is NaN / infinite or whose output is empty are skipped rather than paired.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpojax.data.events import TTCEvent
from dpojax.data.problems import (
    EMPTY_COMPLETION,
    MISSING_FIELD,
    NON_FINITE_SCORE,
    NOT_AN_OBJECT,
    WRONG_TYPE,
    Problem,
    ReadSummary,
    fatal,
    json_value_lines,
    load_json_document,
    type_name,
)
from dpojax.data.records import Prompt, is_message

INPUT_NOT_MESSAGES = "input_not_messages"
OUTPUT_NOT_STRING = "output_not_string"
DUPLICATE_EXAMPLE_ID = "duplicate_example_id"

# (path inside the document, code, reason, skipped)
RawProblem = tuple[tuple, str, str, bool]


class _Skip(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _locate_items(doc: Any) -> tuple[list[Any], tuple] | None:
    """The eval item list and its path in the document, or None for an unknown layout."""
    if isinstance(doc, list):
        return doc, ()
    if isinstance(doc, dict):
        inner = doc.get("eval_input")
        if isinstance(inner, dict) and isinstance(inner.get("eval_input_items"), list):
            return inner["eval_input_items"], ("eval_input", "eval_input_items")
        if isinstance(doc.get("eval_input_items"), list):
            return doc["eval_input_items"], ("eval_input_items",)
    return None


def _nat_int(value: Any, key: str, default: int | None) -> int | None:
    """NAT's (pydantic lax) integer: null gives `default`, integral floats are accepted."""
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Skip(WRONG_TYPE, f"'{key}' must be an integer or null, got {type_name(value)}")


def _nat_prompt(value: Any, flags: list[tuple[str, str]]) -> Prompt:
    """NAT's prompt rule: null -> "", str kept, all-message list -> messages, else `str(value)`."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    flags.append(
        (
            INPUT_NOT_MESSAGES,
            "input is not a string or a list of {role, content} messages; "
            "its Python str() is used as the prompt (as NAT does)",
        )
    )
    return str(value)


def _nat_output(value: Any, flags: list[tuple[str, str]]) -> str:
    """NAT's response rule: `str(output)` when truthy, else "" (then rejected as empty)."""
    text = str(value) if value else ""
    if value and not isinstance(value, str):
        flags.append((OUTPUT_NOT_STRING, f"output is {type_name(value)}; its str() is used"))
    if not text.strip():
        raise _Skip(EMPTY_COMPLETION, "'output' is empty")
    return text


def _event_from_step(
    payload: dict[str, Any], example_id: str, flags: list[tuple[str, str]]
) -> TTCEvent:
    data = payload.get("data")
    if data is None:
        raise _Skip(MISSING_FIELD, "TTC_END step has no data")
    if not isinstance(data, dict):
        raise _Skip(WRONG_TYPE, f"step data must be an object, got {type_name(data)}")
    turn_id = data.get("turn_id")
    if turn_id is None:
        raise _Skip(MISSING_FIELD, "'turn_id' is missing or null")
    if not isinstance(turn_id, str):
        raise _Skip(WRONG_TYPE, f"'turn_id' must be a string, got {type_name(turn_id)}")
    score = data.get("score")
    if score is None:
        raise _Skip(MISSING_FIELD, "'score' is missing or null")
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise _Skip(WRONG_TYPE, f"'score' must be a number, got {type_name(score)}")
    if not math.isfinite(score):
        raise _Skip(NON_FINITE_SCORE, f"'score' is not finite ({float(score)})")
    turn_index = _nat_int(data.get("turn_index"), "turn_index", None)
    candidate_index = _nat_int(data.get("candidate_index"), "candidate_index", 0)
    metadata = payload.get("metadata")
    return TTCEvent(
        example_id=example_id,
        turn_id=turn_id,
        turn_index=turn_index,
        candidate_index=candidate_index,
        input=_nat_prompt(data.get("input"), flags),
        output=_nat_output(data.get("output"), flags),
        score=float(score),
        name=payload["name"],
        metadata=dict(metadata) if isinstance(metadata, dict) else {},
    )


def _unique_items(items: Sequence[Any], problems: list[RawProblem]) -> list[tuple[int, dict]]:
    """NAT's `{item.id: item}`: first-appearance order, the last item with an id wins."""
    by_id: dict[Any, tuple[int, dict]] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            reason = f"eval item must be an object, got {type_name(item)}"
            problems.append(((i,), NOT_AN_OBJECT, reason, True))
        elif "id" not in item:
            problems.append(((i,), MISSING_FIELD, "eval item has no 'id'", True))
        elif isinstance(item["id"], dict | list):
            reason = f"eval item 'id' must be a scalar, got {type_name(item['id'])}"
            problems.append(((i,), WRONG_TYPE, reason, True))
        else:
            if item["id"] in by_id:
                earlier = by_id[item["id"]][0]
                reason = (
                    f"duplicate eval item id {item['id']!r}: item ignored, a later item with the "
                    f"same id (item {i}) replaces it (NAT keeps the last)"
                )
                problems.append(((earlier,), DUPLICATE_EXAMPLE_ID, reason, True))
                by_id[item["id"]] = (i, item)
            else:
                by_id[item["id"]] = (i, item)
    return list(by_id.values())


def events_from_nat_items(
    items: Sequence[Any], *, ttc_step_name: str | None = None
) -> tuple[list[TTCEvent], list[RawProblem], int]:
    """Pure core of the importer: `(events, problems, steps_examined)`.

    Problem paths are relative to the item list: `(item,)` or `(item, steps_key, step)`.
    `ttc_step_name` restricts the import to steps of that exact name (None: every TTC_END step).
    """
    problems: list[RawProblem] = []
    events: list[TTCEvent] = []
    examined = 0
    for i, item in _unique_items(items, problems):
        key = "intermediate_steps" if "intermediate_steps" in item else "trajectory"
        steps = item.get(key)
        if steps is None:
            steps = []
        if not isinstance(steps, list):
            reason = f"'{key}' must be a list, got {type_name(steps)}"
            problems.append(((i,), WRONG_TYPE, reason, True))
            continue
        example_id = str(item["id"])
        for j, step in enumerate(steps):
            if not isinstance(step, dict):
                continue
            payload = step.get("payload", step)
            if not isinstance(payload, dict) or payload.get("event_type") != "TTC_END":
                continue
            name = payload.get("name")
            if not isinstance(name, str) or (ttc_step_name is not None and name != ttc_step_name):
                continue
            examined += 1
            flags: list[tuple[str, str]] = []
            try:
                events.append(_event_from_step(payload, example_id, flags))
            except _Skip as skip:
                problems.append(((i, key, j), skip.code, skip.reason, True))
                continue
            problems.extend(((i, key, j), code, reason, False) for code, reason in flags)
    return events, problems, examined


def import_nat_eval_output(
    path: str | Path, *, strict: bool = False, ttc_step_name: str | None = None
) -> tuple[list[TTCEvent], ReadSummary]:
    """Read a NAT evaluation output file and return `(events, summary)` in trajectory order.

    Problems are reported as `file:line: item I step J: reason` (the line where the step starts).
    By default bad steps are skipped and counted in the summary (logged once); `strict=True` raises
    `DataError` listing every problem, including steps kept but flagged (a prompt or output NAT
    would replace by its Python `str()`). A file that is not UTF-8 / JSON, or has an unknown
    layout, raises `DataError` in both modes.
    """
    doc, text = load_json_document(path)
    located = _locate_items(doc)
    if located is None:
        raise fatal(
            path,
            "not a NAT evaluation output: expected a list of eval items or "
            "{'eval_input': {'eval_input_items': [...]}}",
        )
    items, root = located
    events, raw, examined = events_from_nat_items(items, ttc_step_name=ttc_step_name)
    summary = ReadSummary(str(path), records=examined, kept=len(events))
    lines = json_value_lines(text, [root + p[0] for p in raw]) if raw else {}
    for where, code, reason, skipped in raw:
        label = f"item {where[0]}" + (f" step {where[2]}" if len(where) == 3 else "")
        line = lines.get(root + where)
        summary.add(Problem(str(path), line, code, f"{label}: {reason}", skipped=skipped))
    return events, summary.finish(strict)
