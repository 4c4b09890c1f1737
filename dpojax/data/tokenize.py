"""Preference pairs -> token ids, with TRL 1.16's convention
(docs/layouts.md#tokenization-convention).

Per pair and per completion (chosen, rejected) one *sequence* and its *prompt length*:
- plain text: EOS is appended to the completion unless it already ends with it; the sequence
  is `enc(prompt + completion)` with the tokenizer's own special tokens (BOS for Llama-style
  tokenizers). Conversational (the prompt or the completions are chat messages): the prompt is
  `apply_chat_template(prompt, add_generation_prompt=True)`, the sequence
  `apply_chat_template(prompt + completion messages)` (a plain-text completion is one assistant
  message; several messages, tool calls and results included, are rendered as they are), both
  encoded without extra special tokens (what `apply_chat_template(tokenize=True)` does), with the
  pair's `tools` and chat-template keyword arguments.
- the prompt length is the common token prefix of `enc(prompt)` and the sequence, so the trained
  sequence is exactly the encoded full text even when a merge crosses the boundary (one warning
  per call says how many sequences that happened to).
- truncation per sequence to `max_length`: `keep_start` keeps the first tokens and drops pairs
  whose prompt alone has `max_length` tokens or more; `keep_end` keeps the last tokens (the prompt
  loses its start) and drops nothing.
- over-long texts cost no more than short ones: no vocabulary token spans more than `L`
  characters, so a text of `n` characters has at least `n / L` tokens. A prompt of
  `max_length * L` characters or more is dropped (keep_start) without being tokenized, and a
  sequence text is cut to `(2 * max_length + 64) * L` characters before tokenizing (its end with
  keep_start, its start with keep_end): the cut lies at least `max_length + 64` tokens beyond
  what truncation keeps (docs/layouts.md#tokenization-convention).
A sequence's first token is never scored (nothing predicts it), so the scored tokens of a
sequence are those at positions `>= max(prompt_len, 1)`.

`TokenizedPair` stores the two sequences as their longest common prompt prefix (`prompt_ids`,
shared by the prefix-shared and grouped layouts) plus what follows it in each sequence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpojax.data.pairs import PreferencePair

logger = logging.getLogger("dpojax.data")

TRUNCATION_MODES = ("keep_start", "keep_end")
PROMPT_TOO_LONG = "prompt_too_long"
EMPTY_COMPLETION = "empty_completion"


@dataclass(frozen=True, slots=True, eq=False)
class TokenizedPair:
    """One pair as token ids (int32 arrays).

    The chosen sequence is `prompt_ids + chosen_ids` with prompt length `chosen_prompt_len`
    (>= len(prompt_ids) unless keep_end truncation cut into the prompt); likewise rejected.
    `pair_id` is the pair's index in the source dataset; `group` names the turn (or the prompt)
    the pair belongs to, so the grouped layout can put a turn's candidates behind one prompt.
    `label` is -1 for a preference pair; an unpaired example (`dpojax.data.unpaired_tokens`) is
    a "pair" of its own completion (chosen) and its KL completion (rejected) with its label
    (1 desirable, 0 undesirable).
    """

    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    chosen_prompt_len: int
    rejected_prompt_len: int
    pair_id: int = -1
    group: Hashable = None
    label: int = -1

    def sequence(self, which: str) -> np.ndarray:
        """The full token sequence of `"chosen"` or `"rejected"`."""
        return np.concatenate([self.prompt_ids, self._tail(which)])

    def completion_mask(self, which: str) -> np.ndarray:
        """1 for the sequence's completion tokens, 0 for its prompt tokens (TRL's completion_mask)."""
        n = len(self.prompt_ids) + len(self._tail(which))
        mask = np.zeros(n, np.int32)
        mask[self._prompt_len(which) :] = 1
        return mask

    def skip(self, which: str) -> int:
        """Leading tokens of `chosen_ids` / `rejected_ids` that are not scored."""
        return max(self._prompt_len(which), 1) - len(self.prompt_ids)

    def num_scored(self, which: str) -> int:
        """Completion tokens whose log-prob counts (all but a sequence's very first token)."""
        return len(self._tail(which)) - self.skip(which)

    @property
    def num_tokens(self) -> int:
        """Tokens of the prefix-shared form: prompt once, then both completions."""
        return len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    def _tail(self, which: str) -> np.ndarray:
        if which == "chosen":
            return self.chosen_ids
        if which == "rejected":
            return self.rejected_ids
        raise ValueError(f"which must be 'chosen' or 'rejected', got {which!r}")

    def _prompt_len(self, which: str) -> int:
        self._tail(which)
        return self.chosen_prompt_len if which == "chosen" else self.rejected_prompt_len


class ChatTemplateError(ValueError):
    """The chat template raised while rendering a pair (its message names the error)."""


@dataclass(slots=True)
class TokenizeResult:
    """`pairs` kept (in input order); `dropped` maps a reason to the dropped pairs' ids;
    `boundary_merges` counts sequences whose prompt tokens are not a prefix of the sequence;
    `truncated` counts sequences cut to `max_length`."""

    pairs: list[TokenizedPair]
    dropped: dict[str, list[int]] = field(default_factory=dict)
    boundary_merges: int = 0
    truncated: int = 0

    @property
    def num_dropped(self) -> int:
        return sum(len(v) for v in self.dropped.values())

    def __str__(self) -> str:
        text = f"{len(self.pairs)} pairs tokenized, {self.num_dropped} dropped"
        if self.dropped:
            text += (
                " (" + ", ".join(f"{k}: {len(v)}" for k, v in sorted(self.dropped.items())) + ")"
            )
        return (
            f"{text}; {self.truncated} sequences truncated, {self.boundary_merges} boundary merges"
        )


def group_key(pair: PreferencePair) -> Hashable:
    """The turn a pair belongs to: `(example_id, turn_id)` from its metadata, else its prompt."""
    md = pair.metadata or {}
    if md.get("example_id") is not None and md.get("turn_id") is not None:
        return ("turn", str(md["example_id"]), str(md["turn_id"]))
    return ("prompt", _prompt_key(pair.prompt))


def _prompt_key(prompt: str | list[dict[str, Any]], extra: Any = None) -> Hashable:
    if isinstance(prompt, str) and extra is None:
        return prompt
    if extra is None and all(set(m) <= {"role", "content"} for m in prompt):
        return tuple((m["role"], m["content"]) for m in prompt)
    return json.dumps([prompt, extra], sort_keys=True, default=str)


def _messages(part: str | list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """A prompt or completion as chat messages (plain text is one message of `role`)."""
    return [{"role": role, "content": part}] if isinstance(part, str) else list(part)


class _Encoder:
    """Batched encoding of unique texts, through the Rust tokenizer when that gives equal ids."""

    def __init__(self, tokenizer: Any, chunk_size: int):
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        if backend is not None and (backend.truncation or backend.padding):
            backend = None  # settings the tokenizer's own call would override
        self.backend = backend
        self.checked = False

    def __call__(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is not None and not self.checked:
            self.checked = True
            fast = self._backend(texts[:1], special)
            if fast != self._slow(texts[:1], special):
                self.backend = None  # Python-side processing differs: use the tokenizer itself
        out: list[list[int]] = []
        for i in range(0, len(texts), self.chunk_size):
            chunk = texts[i : i + self.chunk_size]
            out.extend(
                self._backend(chunk, special) if self.backend else self._slow(chunk, special)
            )
        return out

    def _backend(self, texts: list[str], special: bool) -> list[list[int]]:
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=special)]

    def _slow(self, texts: list[str], special: bool) -> list[list[int]]:
        ids = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        return [list(x) for x in ids]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(np.argmax(x))


def _truncate(seq: list[int], k: int, max_length: int | None, mode: str) -> tuple[list[int], int]:
    """(sequence, prompt length) cut to `max_length` tokens."""
    if max_length is None or len(seq) <= max_length:
        return seq, k
    if mode == "keep_start":
        return seq[:max_length], min(k, max_length)
    cut = len(seq) - max_length
    return seq[cut:], max(k - cut, 0)


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters any vocabulary token spans (None when the vocabulary is unknown)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    longest = max((len(t) for t in vocab if isinstance(t, str)), default=0)
    return longest or None


@dataclass(frozen=True, slots=True)
class _Limits:
    """Character bounds derived from `max_length` (see the module docstring)."""

    drop_prompt_chars: int | None  # a prompt this long has >= max_length tokens (keep_start)
    keep_chars: int  # a sequence text is cut to this many characters
    keep_start: bool

    @classmethod
    def create(cls, tokenizer: Any, max_length: int | None, mode: str) -> _Limits | None:
        longest = max_token_chars(tokenizer) if max_length is not None else None
        if longest is None or max_length is None:
            return None
        keep_start = mode == "keep_start"
        drop = max_length * longest if keep_start else None
        return cls(drop, (2 * max_length + 64) * longest, keep_start)

    def cut(self, p: str, c: str, r: str) -> tuple[str, str, str, str] | None:
        """(prompt of chosen, prompt of rejected, prompt + chosen, prompt + rejected) cut to
        the bounds (keep_end cuts each sequence's start, and its prompt's by as much); None
        when the prompt is too long to keep."""
        if self.drop_prompt_chars is not None and len(p) >= self.drop_prompt_chars:
            return None
        n = self.keep_chars
        if self.keep_start:
            return p[:n], p[:n], c[:n], r[:n]
        oc, o_r = max(0, len(c) - n), max(0, len(r) - n)
        return p[oc:], p[o_r:], c[oc:], r[o_r:]


class _Texts:
    """Every distinct text a batch of pairs needs encoded, numbered per kind (plain texts take
    the tokenizer's special tokens, chat-template texts carry their own); a turn's prompt is
    rendered and encoded once."""

    def __init__(
        self,
        tokenizer: Any,
        chat_kwargs: dict[str, Any] | None = None,
        limits: _Limits | None = None,
    ):
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos = tokenizer.eos_token
        self.chat_kwargs = dict(chat_kwargs or {})
        self.tables: dict[bool, dict[str, int]] = {True: {}, False: {}}
        self.chat_prompts: dict[Hashable, str] = {}

    def _index(self, text: str, special: bool) -> int:
        table = self.tables[special]
        return table.setdefault(text, len(table))

    def _chat(self, messages: list[dict[str, Any]], generation: bool, kwargs: dict) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "a pair has chat messages but the tokenizer has no chat template; use a "
                "tokenizer with one (or set data.chat_template), or plain-text pairs"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - a template may raise anything (raise_exception)
            raise ChatTemplateError(f"{type(e).__name__}: {' '.join(str(e).split())}") from e

    def add(self, pair: PreferencePair) -> tuple[bool, int, int, int, int] | None:
        """(special tokens?, prompt of chosen, prompt of rejected, prompt + chosen, prompt +
        rejected) text indices; None when the prompt is too long to keep (decided without
        tokenizing)."""
        if not pair.conversational:
            eos, p, special = self.eos, pair.prompt, True
            c = pair.chosen if eos is None or pair.chosen.endswith(eos) else pair.chosen + eos
            r = pair.rejected if eos is None or pair.rejected.endswith(eos) else pair.rejected + eos
            c, r = p + c, p + r
        else:
            p, c, r = self._chat_texts(pair)
            special = False
        pc = pr = p
        if self.limits is not None:
            texts = self.limits.cut(p, c, r)
            if texts is None:
                return None
            pc, pr, c, r = texts
        index = self._index
        return special, index(pc, special), index(pr, special), index(c, special), index(r, special)

    def _chat_texts(self, pair: PreferencePair) -> tuple[str, str, str]:
        """The rendered prompt, prompt + chosen and prompt + rejected of a conversational pair."""
        kwargs = {**self.chat_kwargs, **(pair.chat_kwargs or {})}
        if pair.tools is not None:
            kwargs["tools"] = pair.tools
        prompt = _messages(pair.prompt, "user")
        key = _prompt_key(prompt, kwargs or None)
        p = self.chat_prompts.get(key)
        if p is None:
            p = self.chat_prompts[key] = self._chat(prompt, True, kwargs)
        c = self._chat([*prompt, *_messages(pair.chosen, "assistant")], False, kwargs)
        r = self._chat([*prompt, *_messages(pair.rejected, "assistant")], False, kwargs)
        return p, c, r

    def encode(self, chunk_size: int) -> dict[bool, list[list[int]]]:
        encoder = _Encoder(self.tokenizer, chunk_size)
        return {special: encoder(list(table), special) for special, table in self.tables.items()}


def _tokenized_pair(
    pair: PreferencePair,
    pid: int,
    prompt: list[int],
    seqs: tuple[list[int], list[int]],
    ks: list[int],
    max_length: int | None,
    truncation_mode: str,
    result: TokenizeResult,
) -> TokenizedPair | None:
    """One pair from its encoded prompt and sequences (`ks`: their prompt lengths), truncated;
    None (and counted in `result.dropped`) when it cannot be used."""
    if any(k >= len(s) for k, s in zip(ks, seqs, strict=True)):
        result.dropped.setdefault(EMPTY_COMPLETION, []).append(int(pid))
        return None
    if truncation_mode == "keep_start" and max_length is not None and len(prompt) >= max_length:
        result.dropped.setdefault(PROMPT_TOO_LONG, []).append(int(pid))
        return None
    (c_seq, kc), (r_seq, kr) = (
        _truncate(s, k, max_length, truncation_mode) for s, k in zip(seqs, ks, strict=True)
    )
    result.truncated += (len(c_seq) < len(seqs[0])) + (len(r_seq) < len(seqs[1]))
    shared = _common_prefix(c_seq[:kc], r_seq[:kr])
    return TokenizedPair(
        prompt_ids=np.array(c_seq[:shared], np.int32),
        chosen_ids=np.array(c_seq[shared:], np.int32),
        rejected_ids=np.array(r_seq[shared:], np.int32),
        chosen_prompt_len=kc,
        rejected_prompt_len=kr,
        pair_id=int(pid),
        group=group_key(pair),
    )


def tokenize_pairs(
    pairs: Sequence[PreferencePair],
    tokenizer: Any,
    *,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pair_ids: Sequence[int] | None = None,
    chunk_size: int = 4096,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokenizeResult:
    """Tokenize `pairs` with the convention in the module docstring.

    `pair_ids` (default 0..n-1) are the pairs' dataset indices, carried into batches. Texts are
    deduplicated (a turn's prompt is encoded once) and encoded in batches of `chunk_size`.
    `chat_template_kwargs` go to every chat template call (a pair's own `chat_kwargs` win).
    """
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}"
        )
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be None or >= 2, got {max_length}")
    if pair_ids is None:
        pair_ids = range(len(pairs))
    elif len(pair_ids) != len(pairs):
        raise ValueError(f"{len(pair_ids)} pair_ids for {len(pairs)} pairs")
    limits = _Limits.create(tokenizer, max_length, truncation_mode)
    texts = _Texts(tokenizer, chat_template_kwargs, limits)
    refs = []
    for pair, pid in zip(pairs, pair_ids, strict=True):
        try:
            refs.append(texts.add(pair))
        except ChatTemplateError as e:
            raise ChatTemplateError(
                f"pair {pid}: the chat template failed on it ({e}); fix the template "
                "(data.chat_template, or the model's tokenizer_config.json / chat_template.jinja) "
                "or that record"
            ) from None
    ids = texts.encode(chunk_size)

    result = TokenizeResult([])
    merge_example: int | None = None
    for pair, pid, ref in zip(pairs, pair_ids, refs, strict=True):
        if ref is None:
            result.dropped.setdefault(PROMPT_TOO_LONG, []).append(int(pid))
            continue
        special, ipc, ipr, ic, ir = ref
        table = ids[special]
        prompts, seqs = (table[ipc], table[ipr]), (table[ic], table[ir])
        ks = [_common_prefix(p, s) for p, s in zip(prompts, seqs, strict=True)]
        merges = sum(k < len(p) for k, p in zip(ks, prompts, strict=True))
        prompt = prompts[0]
        if merges:
            result.boundary_merges += merges
            merge_example = pid if merge_example is None else merge_example
        tokenized = _tokenized_pair(
            pair, pid, prompt, seqs, ks, max_length, truncation_mode, result
        )
        if tokenized is not None:
            result.pairs.append(tokenized)
    if result.boundary_merges:
        logger.warning(
            "%d of %d sequences: a token merge crosses the prompt/completion boundary (first: pair "
            "%s); the prompt length is the common token prefix of enc(prompt) and "
            "enc(prompt + completion)",
            result.boundary_merges,
            2 * len(pairs),
            merge_example,
        )
    if result.dropped:
        logger.warning("tokenization: %s", result)
    return result


def tokenize_pair(
    pair: PreferencePair,
    tokenizer: Any,
    *,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pair_id: int = 0,
) -> TokenizedPair | None:
    """One pair (see `tokenize_pairs`); None if it is dropped."""
    result = tokenize_pairs(
        [pair],
        tokenizer,
        max_length=max_length,
        truncation_mode=truncation_mode,
        pair_ids=[pair_id],
    )
    return result.pairs[0] if result.pairs else None
