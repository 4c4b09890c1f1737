"""Field validators shared by the readers. Each returns the clean value or raises `BadRecord`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from dpojax.data.problems import (
    EMPTY_COMPLETION,
    MISSING_FIELD,
    NON_FINITE_SCORE,
    WRONG_TYPE,
    BadRecord,
    type_name,
)

Message = dict[str, str]
"""A chat message: exactly the keys `role` and `content` (other keys are dropped, as in NAT)."""

Prompt = str | list[Message]

Chat = list[dict[str, Any]]
"""Chat messages as a dataset holds them: each a dict with a string `role`; every key is kept
(`content`, `tool_calls`, `name`, `reasoning_content`, ...) for the chat template to use."""

Completion = str | Chat
"""A completion: plain text, or one or more chat messages (assistant turns, tool calls, tool
results)."""


def get_field(obj: Mapping[str, Any], key: str) -> Any:
    """`obj[key]`, or `BadRecord(missing_field)`."""
    try:
        return obj[key]
    except KeyError:
        raise BadRecord(MISSING_FIELD, f"missing field '{key}'") from None


def wrong_type(key: str, expected: str, value: Any) -> BadRecord:
    return BadRecord(WRONG_TYPE, f"'{key}' must be {expected}, got {type_name(value)}")


def as_str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise wrong_type(key, "a string", value)
    return value


def as_id(value: Any, key: str) -> str:
    """A string or integer identifier, returned as a string."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise wrong_type(key, "a string or an integer", value)


def as_int(value: Any, key: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise wrong_type(key, "an integer" + (" or null" if allow_none else ""), value)


def as_score(value: Any, key: str = "score") -> float:
    """A finite number, as float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(key, "a number", value)
    score = float(value)
    if not math.isfinite(score):
        raise BadRecord(NON_FINITE_SCORE, f"'{key}' is not finite ({score})")
    return score


def is_message(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("role"), str)
        and isinstance(value.get("content"), str)
    )


def as_messages(value: Any, key: str) -> list[Message]:
    """A list of `{role, content}` messages with string values; extra keys dropped."""
    if not isinstance(value, list):
        raise wrong_type(key, "a list of messages", value)
    for i, message in enumerate(value):
        if not is_message(message):
            raise BadRecord(
                WRONG_TYPE, f"'{key}[{i}]' must be an object with string 'role' and 'content'"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def as_chat(value: Any, key: str, *, allow_empty: bool = False) -> Chat:
    """A list of messages (non-empty unless `allow_empty`), each a dict with a string `role` and a
    `content` that is a string, a list (content parts) or null (an assistant turn that only calls
    tools); copies of the dicts with every key kept."""
    if not isinstance(value, list) or not (value or allow_empty):
        raise wrong_type(key, "a non-empty list of messages", value)
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRecord(WRONG_TYPE, f"'{key}[{i}]' must be an object with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRecord(WRONG_TYPE, f"'{key}[{i}].content' must be a string, a list or null")
        out.append(dict(message))
    return out


def as_prompt(value: Any, key: str) -> Prompt:
    """A string, or a list of messages."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return as_messages(value, key)
    raise wrong_type(key, "a string or a list of messages", value)


def as_completion(value: Any, key: str) -> str:
    """A non-empty (not whitespace-only) string."""
    text = as_str(value, key)
    if not text.strip():
        raise BadRecord(EMPTY_COMPLETION, f"'{key}' is empty")
    return text


def as_metadata(value: Any, key: str = "metadata") -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    raise wrong_type(key, "an object or null", value)


def copy_prompt(prompt: Prompt | Completion) -> Prompt | Completion:
    """A copy that shares no mutable message dicts with the original."""
    return prompt if isinstance(prompt, str) else [dict(m) for m in prompt]


def jsonl_text(records: Iterable[Mapping[str, Any]]) -> str:
    """Records as JSON Lines: UTF-8 text kept as is, one object per line and a final newline;
    `ValueError` for a non-finite number (JSON has no NaN)."""
    return "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
