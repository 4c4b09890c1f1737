"""Unpaired examples (KTO) -> token ids, as TRL 1.16's `KTOTrainer` prepares them, laid out as
"pairs" so that the pair machinery (layouts, batches, the forward pass) scores them unchanged.

Per example (`tokenize_unpaired`):
- the prompt and prompt + completion are encoded as the pair tokenizer encodes a pair's prompt
  and sequences (plain text: EOS appended to the completion, the tokenizer's special tokens;
  conversational: the chat template, with the record's `tools` and chat-template arguments); the
  prompt is the common token prefix of the two (TRL's `common_prefix_length`), the completion the
  rest;
- with `max_length`, an example whose prompt has `max_length` tokens or more is dropped (TRL
  drops them whatever the truncation; counted as `prompt_too_long`);
- the KL completion (`dpojax.train.kto.kl_completion_indices`): the completions rotated by one
  within each run of `kl_batch_size` consecutive kept examples, in the data's order, before any
  shuffling (TRL maps `add_kl_completion_ids` over the dataset with batches of
  `per_device_train_batch_size`, then its sampler shuffles); the KL sequence is the example's
  prompt tokens followed by the partner's completion tokens;
- each sequence is then cut to `max_length` (TRL's collator keeps the start; `keep_end` keeps
  the end, which TRL's KTO does not offer).

The result is a `TokenizedPair` per example: chosen = the example's own completion, rejected =
its KL completion, `label` 1 (desirable) or 0, `pair_id` the example's index in the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dpojax.data.pairs import PreferencePair
from dpojax.data.tokenize import (
    PROMPT_TOO_LONG,
    TRUNCATION_MODES,
    TokenizedPair,
    TokenizeResult,
    _common_prefix,
    _truncate,
    tokenize_pairs,
)
from dpojax.data.unpaired import UnpairedExample


def kl_partners(num_examples: int, batch_size: int) -> np.ndarray:
    """For every example, the index of the example whose completion is its KL completion (TRL's
    rotation by one within each run of `batch_size`; a run of one takes its own)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = np.arange(num_examples)
    for start in range(0, num_examples, batch_size):
        stop = min(start + batch_size, num_examples)
        out[start:stop] = np.roll(np.arange(start, stop), 1)
    return out


def _as_pair(example: UnpairedExample) -> PreferencePair:
    """The example as a pair of its completion twice (to encode prompt and prompt + completion
    exactly as the pair tokenizer does)."""
    return PreferencePair(
        example.prompt,
        example.completion,
        example.completion,
        dict(example.metadata),
        tools=example.tools,
        chat_kwargs=example.chat_kwargs,
    )


def _kl_pair(
    own: TokenizedPair, partner: TokenizedPair, max_length: int | None, mode: str
) -> tuple[TokenizedPair, int]:
    """(the example as a pair of its completion and its KL completion, sequences truncated)."""
    prompt = [int(t) for t in own.prompt_ids]
    k = own.chosen_prompt_len
    seqs = [
        prompt + [int(t) for t in own.chosen_ids],
        prompt + [int(t) for t in partner.chosen_ids],
    ]
    (c_seq, kc), (r_seq, kr) = (_truncate(s, k, max_length, mode) for s in seqs)
    cut = (len(c_seq) < len(seqs[0])) + (len(r_seq) < len(seqs[1]))
    shared = _common_prefix(c_seq[:kc], r_seq[:kr])
    pair = TokenizedPair(
        prompt_ids=np.array(c_seq[:shared], np.int32),
        chosen_ids=np.array(c_seq[shared:], np.int32),
        rejected_ids=np.array(r_seq[shared:], np.int32),
        chosen_prompt_len=kc,
        rejected_prompt_len=kr,
        pair_id=own.pair_id,
        group=own.group,
        label=own.label,
    )
    return pair, cut


def tokenize_unpaired(
    examples: Sequence[UnpairedExample],
    tokenizer: Any,
    *,
    kl_batch_size: int,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    chunk_size: int = 4096,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokenizeResult:
    """Tokenize `examples` as the module docstring says; `result.pairs` are the kept examples as
    (own completion, KL completion) pairs, in input order."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}"
        )
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be None or >= 2, got {max_length}")
    whole = tokenize_pairs(
        [_as_pair(e) for e in examples],
        tokenizer,
        chunk_size=chunk_size,
        chat_template_kwargs=chat_template_kwargs,
    )
    result = TokenizeResult([], dict(whole.dropped), whole.boundary_merges // 2)
    kept = []
    for pair in whole.pairs:
        if max_length is not None and pair.chosen_prompt_len >= max_length:
            result.dropped.setdefault(PROMPT_TOO_LONG, []).append(pair.pair_id)
            continue
        label = int(bool(examples[pair.pair_id].label))
        kept.append(
            TokenizedPair(
                pair.prompt_ids[: pair.chosen_prompt_len],
                np.concatenate([pair.prompt_ids[pair.chosen_prompt_len :], pair.chosen_ids]),
                np.zeros(0, np.int32),
                pair.chosen_prompt_len,
                pair.chosen_prompt_len,
                pair_id=pair.pair_id,
                group=pair.group,
                label=label,
            )
        )
    for i, j in enumerate(kl_partners(len(kept), kl_batch_size)):
        pair, cut = _kl_pair(kept[i], kept[int(j)], max_length, truncation_mode)
        result.pairs.append(pair)
        result.truncated += cut
    return result
