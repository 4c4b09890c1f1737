"""An oversized pair costs what a normal one does: lengths are bounded before tokenizing
(docs/layouts.md#tokenization-convention), with the same token ids as tokenizing everything."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dpojax.data import tokenize as tokenize_module
from dpojax.data.pairs import PreferencePair
from dpojax.data.tokenize import PROMPT_TOO_LONG, max_token_chars, tokenize_pairs
from dpojax.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def encoded_lengths(monkeypatch):
    """The length of every text handed to the tokenizer."""
    lengths: list[int] = []
    real = tokenize_module._Encoder.__call__

    def spy(self, texts, special):
        lengths.extend(len(t) for t in texts)
        return real(self, texts, special)

    monkeypatch.setattr(tokenize_module._Encoder, "__call__", spy)
    return lengths


def test_a_huge_prompt_is_dropped_without_tokenizing_it(tok, encoded_lengths):
    """Before: a 50 MB prompt was tokenized three times (110 s, 9.8 GB) before being dropped."""
    huge = "the corner wins " * (3_000_000 // 16)  # 3 MB here; the bound does not depend on it
    pairs = [
        PreferencePair(prompt=huge, chosen=" 5", rejected=" 7", metadata={}),
        PreferencePair(prompt="Your move:", chosen=" 5", rejected=" 7", metadata={}),
    ]
    start = time.perf_counter()
    result = tokenize_pairs(pairs, tok, max_length=64)
    assert time.perf_counter() - start < 2.0
    assert result.dropped == {PROMPT_TOO_LONG: [0]} and len(result.pairs) == 1
    assert max(encoded_lengths) < 100  # only the short pair's texts were encoded


def test_long_completions_are_cut_before_tokenizing_with_the_same_ids(tok, encoded_lengths):
    longest = max_token_chars(tok)
    completion = " because the corner wins" * 20_000  # ~480 kB
    pair = PreferencePair(prompt="Your move:", chosen=completion, rejected=" 7", metadata={})
    for mode in ("keep_start", "keep_end"):
        encoded_lengths.clear()
        bounded = tokenize_pairs([pair], tok, max_length=64, truncation_mode=mode).pairs[0]
        assert max(encoded_lengths) <= (2 * 64 + 64) * longest
        full_chosen = tok("Your move:" + completion + tok.eos_token)["input_ids"]
        kept = full_chosen[:64] if mode == "keep_start" else full_chosen[-64:]
        np.testing.assert_array_equal(bounded.sequence("chosen"), kept)
        assert bounded.num_scored("chosen") > 0


def test_a_prompt_just_under_the_bound_is_still_tokenized(tok):
    short = "a b " * 20  # far fewer than 64 tokens
    result = tokenize_pairs(
        [PreferencePair(prompt=short, chosen=" 5", rejected=" 7", metadata={})], tok, max_length=64
    )
    assert len(result.pairs) == 1 and not result.dropped
