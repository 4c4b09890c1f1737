"""Preference-pair files: NeMo Customizer DPO JSONL and the TRL forms; local HF datasets.

Record forms (one JSON object per line, or one row):
- **customizer**: `prompt` (string or `{role, content}` messages), `chosen_response`,
  `rejected_response` — what NAT's adapter uploads (docs/data.md#pair-files).
- **trl** plain: `prompt`, `chosen`, `rejected` strings. **trl** conversational: `prompt` messages,
  `chosen` / `rejected` each a one-message list `[{"role": "assistant", "content": ...}]`.

An optional `metadata` object is read into `PreferencePair.metadata`; other keys are ignored.

Sources for `read_pairs`: a `.jsonl` file, a `.json` file (JSON lines or one array of records), a
`.parquet` file, a `datasets.save_to_disk` folder (pick a split of a DatasetDict with `split=`), or
a Customizer dataset folder (`training/training_file.jsonl`, `validation/validation_file.jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dpojax.data.pairs import PreferencePair
from dpojax.data.problems import (
    CHOSEN_EQUALS_REJECTED,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    BadRecord,
    Problem,
    ReadSummary,
    fatal,
    iter_jsonl,
    json_value_lines,
    load_json_document,
    type_name,
)
from dpojax.data.records import (
    Prompt,
    as_completion,
    as_messages,
    as_metadata,
    as_prompt,
    copy_prompt,
    get_field,
    wrong_type,
)

READ_FORMATS = ("auto", "customizer", "trl")
WRITE_FORMATS = ("customizer", "trl", "trl_plain", "trl_conversational")
TRAINING_FILE = "training/training_file.jsonl"
VALIDATION_FILE = "validation/validation_file.jsonl"
_KEYS = {"customizer": ("chosen_response", "rejected_response"), "trl": ("chosen", "rejected")}

T = TypeVar("T")


# ----------------------------------------------------------------------------- records -> pairs


def _trl_completion(value: Any, key: str) -> str:
    """A TRL completion: a string, or a list holding exactly one assistant message."""
    if isinstance(value, list):
        messages = as_messages(value, key)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise wrong_type(key, "a string or a list with one assistant message", value)
        value = messages[0]["content"]
    return as_completion(value, key)


def detect_format(obj: dict[str, Any]) -> str:
    """`"customizer"` or `"trl"` from a record's keys; `BadRecord` if it has neither."""
    if "chosen_response" in obj or "rejected_response" in obj:
        return "customizer"
    if "chosen" in obj or "rejected" in obj:
        return "trl"
    raise BadRecord(
        MISSING_FIELD,
        "missing fields: expected 'chosen'/'rejected' (TRL) or "
        "'chosen_response'/'rejected_response' (Customizer)",
    )


def pair_from_record(obj: dict[str, Any], format: str = "auto") -> PreferencePair:
    """Validate one record and return its pair; raises `BadRecord` on the first problem."""
    fmt = detect_format(obj) if format == "auto" else format
    chosen_key, rejected_key = _KEYS[fmt]
    prompt = as_prompt(get_field(obj, "prompt"), "prompt")
    if fmt == "trl":
        chosen = _trl_completion(get_field(obj, chosen_key), chosen_key)
        rejected = _trl_completion(get_field(obj, rejected_key), rejected_key)
    else:
        chosen = as_completion(get_field(obj, chosen_key), chosen_key)
        rejected = as_completion(get_field(obj, rejected_key), rejected_key)
    if chosen == rejected:
        reason = f"'{chosen_key}' and '{rejected_key}' are identical"
        raise BadRecord(CHOSEN_EQUALS_REJECTED, reason)
    metadata = as_metadata(obj.get("metadata"))
    return PreferencePair(prompt, chosen, rejected, dict(metadata or {}))


# ----------------------------------------------------------------------------- sources


# A source yields (position, record); `resolve` maps the positions of bad records to line numbers.
Resolver = Callable[[list[int]], dict[int, int]]


def _identity(positions: list[int]) -> dict[int, int]:
    return {p: p for p in positions}


def _starts_with_bracket(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # read_bytes reports it
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _json_source(path: Path, summary: ReadSummary) -> tuple[Iterator[tuple[int, Any]], Resolver]:
    """JSON lines, or (a `.json` file starting with `[`) one array of records."""
    if path.suffix != ".json" or not _starts_with_bracket(path):
        return iter_jsonl(path, summary), _identity
    doc, text = load_json_document(path)
    summary.records = len(doc)
    resolve = lambda positions: {
        i: line for (i,), line in json_value_lines(text, [(i,) for i in positions]).items()
    }
    return enumerate(doc), resolve


def _rows(path: Path, split: str | None) -> list[dict[str, Any]]:
    """Rows of a parquet file or a `save_to_disk` folder; unreadable sources raise `DataError`."""
    try:
        if path.is_file():
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        import datasets

        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # the libraries raise many types; report them all as DataError
        raise fatal(path, f"cannot read dataset ({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None and len(names) == 1:
            split = names[0]
        if split is None:
            split = "train"
        if split not in loaded:
            raise fatal(path, f"no split {split!r}; available: {', '.join(names)}")
        loaded = loaded[split]
    return loaded.to_list()


def _open_source(
    path: Path, split: str | None, summary: ReadSummary
) -> tuple[Iterator[tuple[int, Any]], Resolver, str, Path]:
    """`(records, resolver, unit, file shown in messages)` for any supported source."""
    if path.is_dir():
        if (path / TRAINING_FILE).is_file():
            name = {None: TRAINING_FILE, "train": TRAINING_FILE, "training": TRAINING_FILE}
            name |= {"validation": VALIDATION_FILE, "val": VALIDATION_FILE}
            if split not in name:
                raise fatal(path, f"no split {split!r}; available: train, validation")
            path = path / name[split]
            return iter_jsonl(path, summary), _identity, "line", path
        if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            raise fatal(
                path, "folder is neither a datasets.save_to_disk folder nor a Customizer set"
            )
    elif not path.exists():
        raise fatal(path, "no such file")
    if path.is_dir() or path.suffix == ".parquet":
        rows = _rows(path, split)
        summary.records = len(rows)
        return enumerate(rows, start=1), _identity, "row", path
    records, resolve = _json_source(path, summary)
    return records, resolve, "line", path


def read_pairs(
    path: str | Path, *, format: str = "auto", split: str | None = None, strict: bool = False
) -> tuple[list[PreferencePair], ReadSummary]:
    """Read preference pairs from a file or folder (module docstring); return `(pairs, summary)`.

    `format`: `"auto"` (per record, from its keys), `"customizer"` or `"trl"`. Bad records (not
    UTF-8, malformed JSON, missing or mistyped fields, empty completions, chosen == rejected) are
    skipped and counted in `summary` (logged once); `strict=True` raises `DataError` listing every
    problem as `file:line: reason` (`file:row N: reason` for datasets and parquet).
    """
    if format not in READ_FORMATS:
        raise ValueError(f"format must be one of {READ_FORMATS}, got {format!r}")
    path = Path(path)
    summary = ReadSummary(str(path))
    records, resolve, unit, shown = _open_source(path, split, summary)
    summary.source = str(shown)
    pairs: list[PreferencePair] = []
    bad: list[tuple[int, str, str]] = []
    for position, obj in records:
        try:
            if not isinstance(obj, dict):
                reason = f"expected a JSON object, got {type_name(obj)}"
                raise BadRecord(NOT_AN_OBJECT, reason)
            pairs.append(pair_from_record(obj, format))
        except BadRecord as exc:
            bad.append((position, exc.code, exc.reason))
    lines = resolve([p for p, _, _ in bad]) if bad else {}
    for position, code, reason in bad:
        summary.add(Problem(str(shown), lines.get(position), code, reason, unit=unit))
    summary.kept = len(pairs)
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
    """`{"prompt", "chosen_response", "rejected_response"}` in NAT's key order."""
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
        prompt = pair.prompt
        record: dict[str, Any] = {
            "prompt": [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else copy_prompt(prompt),
            "chosen": [{"role": "assistant", "content": pair.chosen}],
            "rejected": [{"role": "assistant", "content": pair.rejected}],
        }
    else:
        if not isinstance(pair.prompt, str):
            raise ValueError("a plain TRL record needs a string prompt; use trl_conversational")
        record = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}
    if include_metadata:
        record["metadata"] = dict(pair.metadata)
    return record


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
        format == "trl" and any(not isinstance(p.prompt, str) for p in pairs)
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
    if format == "customizer":
        text = customizer_jsonl(records)
    else:
        text = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
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
