"""Preference records in the shapes datasets use, read the way TRL 1.16's `DPOTrainer` reads them.

A record becomes a `PreferencePair` whatever its shape:

- **explicit prompt**: `prompt`, `chosen`, `rejected`, each plain text or chat messages;
- **implicit prompt**: `chosen` and `rejected` only (Anthropic/hh-rlhf): the prompt is their
  shared leading part, split off as TRL's `extract_prompt` does it: the characters (or messages)
  up to the first one that differs, less a space just before it (so the completions start with
  it); when one is a prefix of the other, up to the last character (message) of the shorter
  one;
- **conversational completions** of one or several messages (an assistant turn, or assistant
  turns with tool calls and tool results): the template renders prompt + completion, and
  everything after the prompt is the completion;
- a plain-text `prompt` column next to conversational completions that begin with that prompt as
  a user turn (HuggingFaceH4/ultrafeedback_binarized): the prompt column is redundant and the
  prompt is extracted from the completions; any other plain prompt next to conversational
  completions becomes one user message.

Per record, a `tools` column (JSON schemas, or their JSON text) and a `chat_template_kwargs`
column (an object, or its JSON text) are passed to the chat template, as TRL does. A
`RecordShape` maps the column names (`columns={"prompt": "question"}`) and adds a system prompt to
conversational prompts that have none.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpojax.data.pairs import PreferencePair
from dpojax.data.problems import (
    CHOSEN_EQUALS_REJECTED,
    EMPTY_COMPLETION,
    MISSING_FIELD,
    WRONG_TYPE,
    BadRecord,
)
from dpojax.data.records import Completion, as_chat, as_metadata, wrong_type

COLUMN_KEYS = ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs")
NO_SHARED_PROMPT = "no_shared_prompt"
SYSTEM_PROMPT_PLAIN = "system_prompt_on_plain_text"


@dataclasses.dataclass(frozen=True)
class RecordShape:
    """How a dataset's records map to pairs: `columns` maps dpojax's names (`COLUMN_KEYS`) to the
    dataset's column names (unmapped names are used as they are); `system_prompt` is put first
    in every conversational prompt that does not start with a system message."""

    columns: tuple[tuple[str, str], ...] = ()
    system_prompt: str = ""

    @classmethod
    def create(cls, columns: Mapping[str, str] | None = None, system_prompt: str = ""):
        columns = {k: v for k, v in (columns or {}).items() if v}
        unknown = sorted(set(columns) - set(COLUMN_KEYS))
        if unknown:
            raise ValueError(f"unknown column names {unknown}; known: {', '.join(COLUMN_KEYS)}")
        return cls(tuple(sorted(columns.items())), system_prompt)

    def column(self, key: str) -> str:
        return dict(self.columns).get(key, key)

    @property
    def is_default(self) -> bool:
        return not self.columns and not self.system_prompt


def extract_prompt(chosen: Completion, rejected: Completion) -> tuple[Completion, ...]:
    """(prompt, chosen, rejected) split at the end of the shared leading part of two texts or two
    message lists (module docstring); `BadRecord` when they share nothing."""
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if cut is None:
        cut = n - 1  # one is a prefix of the other: TRL keeps the last shared item out
    elif cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    if cut <= 0:
        raise BadRecord(
            NO_SHARED_PROMPT,
            "no 'prompt' field, and 'chosen' and 'rejected' share no leading part to use as one",
        )
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _is_blank(message: Mapping[str, Any]) -> bool:
    """A message with no text (empty or whitespace content) and nothing else (no tool calls)."""
    content = message.get("content")
    extra = {k for k, v in message.items() if v is not None} - {"role", "content"}
    return not extra and (content is None or (isinstance(content, str) and not content.strip()))


def completion_field(value: Any, key: str) -> Completion:
    """A plain-text completion, or chat messages; `BadRecord` when it holds nothing."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord(EMPTY_COMPLETION, f"'{key}' is empty")
        return value
    if isinstance(value, list):
        messages = as_chat(value, key)
        if all(_is_blank(m) for m in messages):
            raise BadRecord(EMPTY_COMPLETION, f"'{key}' is empty")
        return messages
    raise wrong_type(key, "a string or a list of messages", value)


def json_field(value: Any, key: str, kind: type) -> Any:
    """A list / dict column, or its JSON text; None stays None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRecord(WRONG_TYPE, f"'{key}' is not valid JSON ({e.msg})") from None
    if value is not None and not isinstance(value, kind):
        raise wrong_type(key, f"a {'list' if kind is list else 'JSON object'}", value)
    return value


def _redundant_prompt(prompt: str, chosen: list, rejected: list) -> bool:
    """A plain prompt that the conversational completions already start with, as a user turn."""
    firsts = [c[0] for c in (chosen, rejected)]
    return all(m.get("role") == "user" and m.get("content") == prompt for m in firsts)


def _prompt_and_completions(obj: Mapping[str, Any], shape: RecordShape) -> tuple[Completion, ...]:
    keys = {k: shape.column(k) for k in ("prompt", "chosen", "rejected")}
    for key in ("chosen", "rejected"):
        if keys[key] not in obj:
            raise BadRecord(MISSING_FIELD, f"missing field '{keys[key]}'")
    chosen = completion_field(obj[keys["chosen"]], keys["chosen"])
    rejected = completion_field(obj[keys["rejected"]], keys["rejected"])
    if type(chosen) is not type(rejected):
        raise BadRecord(
            WRONG_TYPE,
            f"'{keys['chosen']}' and '{keys['rejected']}' must both be text or both messages",
        )
    prompt = obj.get(keys["prompt"])
    if prompt is None or (
        isinstance(prompt, str)
        and isinstance(chosen, list)
        and _redundant_prompt(prompt, chosen, rejected)
    ):
        return extract_prompt(chosen, rejected)
    if isinstance(prompt, list):
        prompt = as_chat(prompt, keys["prompt"], allow_empty=True)
    elif not isinstance(prompt, str):
        raise wrong_type(keys["prompt"], "a string or a list of messages", prompt)
    elif isinstance(chosen, list):
        prompt = [{"role": "user", "content": prompt}]
    return prompt, chosen, rejected


def with_system_prompt(prompt: Completion, system_prompt: str) -> Completion:
    if not system_prompt:
        return prompt
    if isinstance(prompt, str):
        raise BadRecord(
            SYSTEM_PROMPT_PLAIN,
            "data.system_prompt applies to conversational prompts, and this prompt is plain text",
        )
    if prompt and prompt[0].get("role") == "system":
        return prompt
    return [{"role": "system", "content": system_prompt}, *prompt]


def pair_from_shaped_record(obj: Mapping[str, Any], shape: RecordShape) -> PreferencePair:
    """One record of any shape in the module docstring as a pair; `BadRecord` on the first
    problem."""
    prompt, chosen, rejected = _prompt_and_completions(obj, shape)
    if chosen == rejected:
        raise BadRecord(CHOSEN_EQUALS_REJECTED, "'chosen' and 'rejected' are identical")
    prompt = with_system_prompt(prompt, shape.system_prompt)
    tools = json_field(obj.get(shape.column("tools")), shape.column("tools"), list)
    kwargs_key = shape.column("chat_template_kwargs")
    chat_kwargs = json_field(obj.get(kwargs_key), kwargs_key, dict)
    metadata = as_metadata(obj.get("metadata"))
    return PreferencePair(
        prompt,
        plain_turn(chosen),
        plain_turn(rejected),
        dict(metadata or {}),
        tools=tools,
        chat_kwargs=chat_kwargs,
    )


def plain_turn(completion: Completion) -> Completion:
    """One assistant message of text only, as its text (the form every pair writer takes; the
    tokenizer renders it back as that message); any other completion as it is."""
    if isinstance(completion, list) and len(completion) == 1:
        message = completion[0]
        text = message.get("content")
        extra = {k for k, v in message.items() if v is not None} - {"role", "content"}
        if message["role"] == "assistant" and isinstance(text, str) and not extra:
            return text
    return completion


def read_chat_template(value: str) -> str | None:
    """The chat template `value` names: None for "", the text itself when it holds Jinja
    (`{{` or `{%`), else the content of the file at that path (a `chat_template.json` gives its
    `chat_template` field); ValueError for anything else."""
    if not value:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value!r} is neither a file nor a Jinja template")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}: no 'chat_template' field") from None
        if not isinstance(text, str):
            raise ValueError(f"{path}: 'chat_template' is not a string")
    if "{{" not in text and "{%" not in text:
        raise ValueError(f"{path} does not hold a Jinja template")
    return text
