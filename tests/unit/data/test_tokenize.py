"""Tokenization follows TRL's convention (docs/layouts.md#tokenization-convention): expected ids written out by hand."""

import copy
import logging
import random

import numpy as np
import pytest

from dpojax.data.pairs import PreferencePair
from dpojax.data.tokenize import (
    EMPTY_COMPLETION,
    PROMPT_TOO_LONG,
    group_key,
    tokenize_pair,
    tokenize_pairs,
)
from dpojax.models.tiny import _WORDS, build_tokenizer

PROMPT = "You are X. Your move:"
PROMPT_TOKENS = ["<|bos|>", "You", "Ġare", "ĠX", ".", "ĠYour", "Ġmove", ":"]
LONG = " 1 because the corner wins"
LONG_TOKENS = ["Ġ1", "Ġbe", "c", "a", "u", "s", "e", "Ġthe", "Ġcorner", "Ġwins", "<|eos|>"]
CHAT_PROMPT = [{"role": "system", "content": "Play X."}, {"role": "user", "content": "Your move?"}]
CHAT_PROMPT_TOKENS = ["<|bos|>", "<|system|>", "Ċ", "P", "lay", "ĠX", ".", "<|end|>", "Ċ"] + [
    "<|user|>",
    "Ċ",
    "You",
    "r",
    "Ġmove",
    "?",
    "<|end|>",
    "Ċ",
    "<|assistant|>",
    "Ċ",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, tokens: list[str]) -> list[int]:
    out = tok.convert_tokens_to_ids(tokens)
    assert tok.unk_token_id not in out or tok.unk_token_id is None
    return out


def check(tp, which, tok, tokens, prompt_len):
    assert tp.sequence(which).tolist() == ids(tok, tokens)
    assert tp.completion_mask(which).tolist() == [0] * prompt_len + [1] * (len(tokens) - prompt_len)
    assert tp.sequence(which).dtype == np.int32


def test_plain_text_bos_once_eos_appended(tok):
    tp = tokenize_pair(PreferencePair(PROMPT, " 5", " 7"), tok)
    check(tp, "chosen", tok, PROMPT_TOKENS + ["Ġ5", "<|eos|>"], 8)
    check(tp, "rejected", tok, PROMPT_TOKENS + ["Ġ7", "<|eos|>"], 8)
    assert tp.prompt_ids.tolist() == ids(tok, PROMPT_TOKENS)
    assert tp.chosen_ids.tolist() == ids(tok, ["Ġ5", "<|eos|>"])
    assert tp.num_scored("chosen") == 2 and tp.skip("chosen") == 0


def test_eos_not_doubled(tok):
    tp = tokenize_pair(PreferencePair(PROMPT, " 5<|eos|>", " 7"), tok)
    check(tp, "chosen", tok, PROMPT_TOKENS + ["Ġ5", "<|eos|>"], 8)


def test_boundary_merge_splits_at_common_prefix_and_warns_once(tok, caplog):
    # enc("... move: ") ends with "Ġ", which merges with the completion's first digit.
    assert tok.convert_ids_to_tokens(tok(PROMPT + " ")["input_ids"]) == PROMPT_TOKENS + ["Ġ"]
    pairs = [PreferencePair(PROMPT + " ", "5", "7"), PreferencePair(PROMPT + " ", "3", "9")]
    with caplog.at_level(logging.WARNING, logger="dpojax.data"):
        result = tokenize_pairs(pairs, tok)
    merges = [r for r in caplog.records if "crosses the prompt/completion boundary" in r.message]
    assert len(merges) == 1 and "4 of 4 sequences" in merges[0].getMessage()
    assert result.boundary_merges == 4
    tp = result.pairs[0]
    check(tp, "chosen", tok, PROMPT_TOKENS + ["Ġ5", "<|eos|>"], 8)  # exactly enc(prompt + chosen)
    check(tp, "rejected", tok, PROMPT_TOKENS + ["Ġ7", "<|eos|>"], 8)


def test_merge_that_differs_between_chosen_and_rejected(tok):
    # "The boa" + "rd" -> "Ġboard" merges across the boundary; "The boa" + "t" does not merge as far.
    tp = tokenize_pair(PreferencePair("The boa", "rd", "t"), tok)
    for which, text in (("chosen", "The board"), ("rejected", "The boat")):
        seq = tok(text + "<|eos|>")["input_ids"]
        assert tp.sequence(which).tolist() == seq
        full_prompt = tok("The boa")["input_ids"]
        k = next(i for i, (a, b) in enumerate(zip(full_prompt + [-1], seq, strict=False)) if a != b)
        assert tp.completion_mask(which).tolist() == [0] * k + [1] * (len(seq) - k)
    assert len(tp.prompt_ids) == min(tp.chosen_prompt_len, tp.rejected_prompt_len)


def test_chat_template(tok):
    tp = tokenize_pair(PreferencePair(CHAT_PROMPT, "9", "the center"), tok)
    n = len(CHAT_PROMPT_TOKENS)
    check(tp, "chosen", tok, CHAT_PROMPT_TOKENS + ["9", "<|end|>", "Ċ"], n)  # no EOS added
    full = [*CHAT_PROMPT, {"role": "assistant", "content": "the center"}]
    expected = tok.apply_chat_template(full, tokenize=True)["input_ids"]
    assert tp.sequence("rejected").tolist() == list(expected)
    prompt = tok.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, tokenize=True)
    assert tp.prompt_ids.tolist() == list(prompt["input_ids"]) == ids(tok, CHAT_PROMPT_TOKENS)


def test_truncation_keep_start(tok):
    pair = PreferencePair(PROMPT, " 5", LONG)
    tp = tokenize_pair(pair, tok, max_length=11)
    check(tp, "chosen", tok, PROMPT_TOKENS + ["Ġ5", "<|eos|>"], 8)  # fits: untouched
    check(tp, "rejected", tok, PROMPT_TOKENS + LONG_TOKENS[:3], 8)
    # A prompt that alone fills max_length drops the pair, and is counted.
    result = tokenize_pairs([pair, pair], tok, max_length=8, pair_ids=[7, 9])
    assert result.pairs == [] and result.dropped == {PROMPT_TOO_LONG: [7, 9]}
    assert tokenize_pair(pair, tok, max_length=9).num_scored("rejected") == 1


def test_truncation_keep_end(tok):
    pair = PreferencePair(PROMPT, " 5", LONG)
    tp = tokenize_pair(pair, tok, max_length=6, truncation_mode="keep_end")
    check(tp, "chosen", tok, PROMPT_TOKENS[-4:] + ["Ġ5", "<|eos|>"], 4)
    check(tp, "rejected", tok, LONG_TOKENS[-6:], 0)  # the prompt is gone entirely
    assert tp.prompt_ids.tolist() == []  # the two sequences share no prompt tokens
    # A sequence's first token has no prediction: it is never scored.
    assert tp.num_scored("rejected") == 5 and tp.skip("rejected") == 1
    assert tp.num_scored("chosen") == 2 and tp.skip("chosen") == 4


def test_batched_path_equals_per_text_calls(tok):
    rng = random.Random(0)
    text = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))
    pairs = [
        PreferencePair(text(rng.randint(1, 30)), text(rng.randint(1, 9)), "x") for _ in range(50)
    ]
    result = tokenize_pairs(pairs, tok)
    for pair, tp in zip(pairs, result.pairs, strict=True):
        assert (
            tp.sequence("chosen").tolist()
            == tok(pair.prompt + pair.chosen + "<|eos|>")["input_ids"]
        )
        assert tp.sequence("rejected").tolist() == tok(pair.prompt + "x<|eos|>")["input_ids"]


def test_pair_ids_groups_and_empty_completion(tok):
    ttc = PreferencePair(PROMPT, " 5", " 7", {"example_id": "g1", "turn_id": 0, "chosen_index": 2})
    assert group_key(ttc) == ("turn", "g1", "0")
    assert group_key(PreferencePair(CHAT_PROMPT, "a", "b")) == group_key(
        PreferencePair([dict(m) for m in CHAT_PROMPT], "c", "d")
    )
    result = tokenize_pairs([ttc, PreferencePair(PROMPT, " 5", " 7")], tok, pair_ids=[10, 11])
    assert [p.pair_id for p in result.pairs] == [10, 11]
    assert result.pairs[0].group == ("turn", "g1", "0")
    assert result.pairs[1].group == ("prompt", PROMPT)

    class NoEos:  # a tokenizer whose template emits nothing for the assistant turn
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return tok.apply_chat_template(
                messages[:1], tokenize=False, add_generation_prompt=add_generation_prompt
            )

    result = tokenize_pairs([PreferencePair(CHAT_PROMPT, "a", "b")], NoEos(), pair_ids=[3])
    assert result.dropped == {EMPTY_COMPLETION: [3]}


def test_bad_arguments(tok):
    no_template = copy.copy(tok)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_pairs([PreferencePair(CHAT_PROMPT, "a", "b")], no_template)
    with pytest.raises(ValueError, match="truncation_mode"):
        tokenize_pairs([], tok, truncation_mode="middle")
    with pytest.raises(ValueError, match="pair_ids"):
        tokenize_pairs([PreferencePair(PROMPT, "a", "b")], tok, pair_ids=[1, 2])


def test_a_raising_chat_template_names_the_pair_and_the_fix():
    """Before: `TemplateError: boom` (exit 1) naming no key, file or record."""
    from dpojax.data.tokenize import ChatTemplateError

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['content'] == 'bad' %}{{ raise_exception('boom') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    good = PreferencePair([{"role": "user", "content": "hi"}], "yes", "no")
    bad = PreferencePair([{"role": "user", "content": "hi"}], "bad", "no")
    with pytest.raises(ChatTemplateError) as info:
        tokenize_pairs([good, bad], tokenizer, pair_ids=[10, 11])
    message = str(info.value)
    assert message.startswith("pair 11: the chat template failed on it")
    assert "boom" in message and "data.chat_template" in message and "\n" not in message
    assert isinstance(info.value, ValueError)  # bad data: exit 3 with its one line
