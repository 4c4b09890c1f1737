"""Preference-pair files: NeMo Customizer DPO JSONL and the TRL forms; local HF datasets.

Record forms (one JSON object per line, or one row):
- **customizer**: `prompt` (string or `{role, content}` messages), `chosen_response`,
  `rejected_response` — what NAT's adapter uploads (docs/data.md#pair-files).
- **trl**: `chosen` and `rejected` with an explicit or implicit `prompt`, plain text or chat
  messages, completions of one or several messages, per-record `tools` and
  `chat_template_kwargs`, columns under other names (`dpojax.data.shapes`).

An optional `metadata` object is read into `PreferencePair.metadata`; other keys are ignored.

Sources for `read_pairs`: local files and folders of every common kind and Hub dataset ids
(`dpojax.data.sources`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dpojax.data.pairs import PreferencePair
from dpojax.data.problems import (
    CHOSEN_EQUALS_REJECTED,
    DUPLICATE_KEY,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    BadRecord,
    DuplicateKeys,
    Problem,
    ReadSummary,
    type_name,
)
from dpojax.data.records import (
    Completion,
    Prompt,
    as_completion,
    as_metadata,
    as_prompt,
    copy_prompt,
    get_field,
    jsonl_text,
)
from dpojax.data.shapes import RecordShape, pair_from_shaped_record, with_system_prompt
from dpojax.data.sources import TRAINING_FILE, VALIDATION_FILE, open_source

READ_FORMATS = ("auto", "customizer", "trl")
WRITE_FORMATS = ("customizer", "trl", "trl_plain", "trl_conversational")
__all__ = ["TRAINING_FILE", "VALIDATION_FILE"]

T = TypeVar("T")


# ----------------------------------------------------------------------------- records -> pairs


def detect_format(obj: dict[str, Any], shape: RecordShape | None = None) -> str:
    """`"customizer"` or `"trl"` from a record's keys; `BadRecord` if it has neither."""
    shape = shape or RecordShape()
    if shape.columns:
        return "trl"
    if "chosen_response" in obj or "rejected_response" in obj:
        return "customizer"
    if "chosen" in obj or "rejected" in obj:
        return "trl"
    raise BadRecord(
        MISSING_FIELD,
        "missing fields: expected 'chosen'/'rejected' (TRL) or "
        "'chosen_response'/'rejected_response' (Customizer)",
    )


def pair_from_record(
    obj: dict[str, Any], format: str = "auto", shape: RecordShape | None = None
) -> PreferencePair:
    """Validate one record and return its pair; raises `BadRecord` on the first problem.

    TRL records may take any shape of `dpojax.data.shapes` (explicit or implicit prompt, plain
    or conversational, multi-turn completions, tools); `shape` maps their columns and adds a
    system prompt."""
    fmt = detect_format(obj, shape) if format == "auto" else format
    if fmt == "trl":
        return pair_from_shaped_record(obj, shape or RecordShape())
    prompt = as_prompt(get_field(obj, "prompt"), "prompt")
    chosen = as_completion(get_field(obj, "chosen_response"), "chosen_response")
    rejected = as_completion(get_field(obj, "rejected_response"), "rejected_response")
    if chosen == rejected:
        reason = "'chosen_response' and 'rejected_response' are identical"
        raise BadRecord(CHOSEN_EQUALS_REJECTED, reason)
    metadata = as_metadata(obj.get("metadata"))
    if shape is not None:
        prompt = with_system_prompt(prompt, shape.system_prompt)
    return PreferencePair(prompt, chosen, rejected, dict(metadata or {}))


# ----------------------------------------------------------------------------- reading


def iter_pairs(
    path: str | Path,
    summary: ReadSummary,
    *,
    format: str = "auto",
    split: str | None = None,
    subset: str | None = None,
    shape: RecordShape | None = None,
    streaming: bool = False,
) -> Iterator[tuple[int, PreferencePair]]:
    """`(position, pair)` for every good record of a source (`dpojax.data.sources`), as it is
    read; the bad ones are added to `summary` (as problems) once the source is exhausted, and
    `summary.kept` is set. Call `summary.finish(strict)` afterwards."""
    if format not in READ_FORMATS:
        raise ValueError(f"format must be one of {READ_FORMATS}, got {format!r}")
    yield from iter_records(
        path,
        summary,
        lambda obj: pair_from_record(obj, format, shape),
        split=split,
        subset=subset,
        streaming=streaming,
    )


def iter_records(
    path: str | Path,
    summary: ReadSummary,
    convert: Callable[[dict], Any],
    *,
    split: str | None = None,
    subset: str | None = None,
    streaming: bool = False,
) -> Iterator[tuple[int, Any]]:
    """`(position, convert(record))` for every record of a source that is a JSON object and that
    `convert` takes (it raises `BadRecord` for one it refuses); the bad ones are added to
    `summary` once the source is exhausted, and `summary.kept` is set (`iter_pairs`, and the
    unpaired records' reader)."""
    source = open_source(path, summary, split=split, subset=subset, streaming=streaming)
    summary.source = source.shown
    bad: list[tuple[int, str, str]] = []
    kept = 0
    for position, obj in source.records:
        try:
            if not isinstance(obj, dict):
                reason = f"expected a JSON object, got {type_name(obj)}"
                raise BadRecord(NOT_AN_OBJECT, reason)
            if isinstance(obj, DuplicateKeys):  # a record of a JSON array
                raise BadRecord(DUPLICATE_KEY, obj.reason())
            item = convert(obj)
        except BadRecord as exc:
            bad.append((position, exc.code, exc.reason))
            continue
        kept += 1
        yield position, item
    if streaming and not summary.records:
        summary.records = kept + len(bad)
    lines = source.resolve([p for p, _, _ in bad]) if bad else {}
    for position, code, reason in bad:
        summary.add(Problem(source.shown, lines.get(position), code, reason, unit=source.unit))
    summary.kept = kept


def read_pairs(
    path: str | Path,
    *,
    format: str = "auto",
    split: str | None = None,
    strict: bool = False,
    subset: str | None = None,
    shape: RecordShape | None = None,
    streaming: bool = False,
) -> tuple[list[PreferencePair], ReadSummary]:
    """Read preference pairs from a file, a folder or a Hub dataset (module docstring); return
    `(pairs, summary)`.

    `format`: `"auto"` (per record, from its keys), `"customizer"` or `"trl"`. Bad records (not
    UTF-8, malformed JSON, missing or mistyped fields, empty completions, chosen == rejected) are
    skipped and counted in `summary` (logged once); `strict=True` raises `DataError` listing every
    problem as `file:line: reason` (`source:row N: reason` for datasets and parquet).
    """
    summary = ReadSummary(str(path))
    pairs = [
        pair
        for _, pair in iter_pairs(
            path,
            summary,
            format=format,
            split=split,
            subset=subset,
            shape=shape,
            streaming=streaming,
        )
    ]
    return pairs, summary.finish(strict)


# ----------------------------------------------------------------------------- pairs -> records


def customizer_prompt(prompt: Prompt, use_full_message_history: bool = False) -> Prompt:
    """NAT's adapter rule: full history gives messages (a string becomes one user message);
    otherwise a string stays and a message list becomes its last message's content ("" if empty)."""
    if use_full_message_history:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    if isinstance(prompt, str):
        return prompt
    return prompt[-1]["content"] if prompt else ""


def customizer_record(
    pair: PreferencePair, use_full_message_history: bool = False
) -> dict[str, Any]:
    """`{"prompt", "chosen_response", "rejected_response"}` in NAT's key order. Customizer
    completions are text: a pair whose completions are chat messages is refused."""
    if not (isinstance(pair.chosen, str) and isinstance(pair.rejected, str)):
        raise ValueError(
            "a Customizer record needs text completions; this pair's completions are chat "
            "messages (several turns or tool calls): write it in the TRL form instead"
        )
    return {
        "prompt": customizer_prompt(pair.prompt, use_full_message_history),
        "chosen_response": pair.chosen,
        "rejected_response": pair.rejected,
    }


def trl_record(
    pair: PreferencePair, conversational: bool, include_metadata: bool = False
) -> dict[str, Any]:
    """TRL's plain or conversational preference record (string prompts become one user message)."""
    if conversational:
        record: dict[str, Any] = {
            "prompt": _as_messages(pair.prompt, "user"),
            "chosen": _as_messages(pair.chosen, "assistant"),
            "rejected": _as_messages(pair.rejected, "assistant"),
        }
    else:
        if pair.conversational:
            raise ValueError(
                "a plain TRL record needs a string prompt and text completions; use "
                "trl_conversational"
            )
        record = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}
    if pair.tools is not None:
        record["tools"] = pair.tools
    if pair.chat_kwargs is not None:
        record["chat_template_kwargs"] = dict(pair.chat_kwargs)
    if include_metadata:
        record["metadata"] = dict(pair.metadata)
    return record


def _as_messages(part: Prompt | Completion, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": part}] if isinstance(part, str) else copy_prompt(part)


def pairs_to_records(
    pairs: Sequence[PreferencePair],
    format: str = "trl",
    *,
    use_full_message_history: bool = False,
    include_metadata: bool = False,
) -> list[dict[str, Any]]:
    """Records of one form for every pair (e.g. for `datasets.Dataset.from_list`).

    `"trl"` writes the plain form when every prompt is a string, else the conversational form.
    `use_full_message_history` applies to `"customizer"`, `include_metadata` to the TRL forms.
    """
    if format not in WRITE_FORMATS:
        raise ValueError(f"format must be one of {WRITE_FORMATS}, got {format!r}")
    if format == "customizer":
        return [customizer_record(p, use_full_message_history) for p in pairs]
    conversational = format == "trl_conversational" or (
        format == "trl" and any(p.conversational for p in pairs)
    )
    return [trl_record(p, conversational, include_metadata) for p in pairs]


def customizer_split(items: Sequence[T]) -> tuple[list[T], list[T]]:
    """NAT's ordered split: the first `k = max(1, floor(0.8 N))` items train, the rest validate;
    when nothing is left (N = 1) the last item is duplicated into validation."""
    if not items:
        raise ValueError("No DPO items to split")
    k = max(1, len(items) * 4 // 5)  # == int(N * 0.8) exactly
    train, validation = list(items[:k]), list(items[k:])
    return train, validation or [items[-1]]


def customizer_jsonl(records: Sequence[dict[str, Any]]) -> str:
    """NAT's serialisation: default `json.dumps` (ASCII escapes), "\\n"-joined, no final newline."""
    return "\n".join(json.dumps(r) for r in records)


def write_pairs(
    pairs: Sequence[PreferencePair],
    path: str | Path,
    *,
    format: str = "trl",
    use_full_message_history: bool = False,
    include_metadata: bool = False,
) -> Path:
    """Write one JSONL file of `format` (see `pairs_to_records`). Customizer files use NAT's exact
    serialisation; TRL files are UTF-8 with one record per line and a final newline."""
    path = Path(path)
    records = pairs_to_records(
        pairs,
        format,
        use_full_message_history=use_full_message_history,
        include_metadata=include_metadata,
    )
    text = customizer_jsonl(records) if format == "customizer" else jsonl_text(records)
    path.write_text(text, encoding="utf-8")
    return path


def write_customizer_files(
    pairs: Sequence[PreferencePair], out_dir: str | Path, *, use_full_message_history: bool = False
) -> tuple[Path, Path]:
    """Write `training/training_file.jsonl` and `validation/validation_file.jsonl` under `out_dir`
    (the repo layout NAT uploads), split 80/20 in order. Returns both paths."""
    if not pairs:
        raise ValueError("No DPO items found in pairs")
    records = [customizer_record(p, use_full_message_history) for p in pairs]
    train, validation = customizer_split(records)
    out = []
    for name, part in ((TRAINING_FILE, train), (VALIDATION_FILE, validation)):
        target = Path(out_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(customizer_jsonl(part), encoding="utf-8")
        out.append(target)
    return out[0], out[1]
