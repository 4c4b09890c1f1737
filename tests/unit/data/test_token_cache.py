"""The token cache returns exactly what tokenize_pairs returns, and misses whenever an input that
decides the ids changes."""

import logging
import os

import numpy as np
import pytest

from dpojax.data.pairs import PreferencePair
from dpojax.data.token_cache import tokenize_pairs_cached, tokenizer_fingerprint
from dpojax.data.tokenize import PROMPT_TOO_LONG, tokenize_pairs
from dpojax.models.tiny import _WORDS, build_tokenizer

CHAT = [{"role": "system", "content": "Play X."}, {"role": "user", "content": "Your move?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def mixed_pairs() -> list[PreferencePair]:
    """Plain and chat prompts, turn metadata, a boundary merge, a prompt too long for
    max_length=24, a truncated completion, and a completion that is just EOS."""
    turn = {"example_id": "g1", "turn_id": "3"}
    long_prompt = " ".join(_WORDS[:40])
    return [
        PreferencePair("You are X. Your move:", " 5", " 7", dict(turn)),
        PreferencePair("You are X. Your move:", " 5", " 9", dict(turn)),
        PreferencePair("You are X. Your move: ", "4", "6"),  # "Ġ" merges with the digit
        PreferencePair(CHAT, "5", "the corner wins"),
        PreferencePair(long_prompt, " a", " b"),  # dropped: prompt too long
        PreferencePair("Short:", " " + " ".join(_WORDS[:30]), " no"),  # truncated
        PreferencePair("Ends with eos", "<|eos|>", " x"),
    ]


def same(a, b):
    assert str(a) == str(b)
    assert a.dropped == b.dropped
    assert (a.boundary_merges, a.truncated) == (b.boundary_merges, b.truncated)
    assert len(a.pairs) == len(b.pairs)
    for x, y in zip(a.pairs, b.pairs, strict=True):
        for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
            assert getattr(y, name).dtype == np.int32
        assert (x.chosen_prompt_len, x.rejected_prompt_len) == (
            y.chosen_prompt_len,
            y.rejected_prompt_len,
        )
        assert (x.pair_id, x.group) == (y.pair_id, y.group)


def test_hit_returns_exactly_the_fresh_tokenization(tok, tmp_path):
    pairs = mixed_pairs()
    kw = dict(max_length=24, truncation_mode="keep_start", pair_ids=[10, 11, 12, 13, 14, 15, 16])
    fresh = tokenize_pairs(pairs, tok, **kw)
    assert fresh.dropped[PROMPT_TOO_LONG] == [14] and fresh.boundary_merges == 2
    assert fresh.dropped == {PROMPT_TOO_LONG: [14]}
    assert fresh.truncated == 2 and len(fresh.pairs) == 6
    miss, hit = tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **kw)
    assert not hit
    same(fresh, miss)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("tokens-") and files[0].suffix == ".npz"
    cached, hit = tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **kw)
    assert hit
    same(fresh, cached)
    # keep_end keeps the long prompt's tail: another entry, equal to its own fresh result
    kw_end = dict(kw, truncation_mode="keep_end")
    tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **kw_end)
    cached_end, hit = tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **kw_end)
    assert hit and len(list(tmp_path.iterdir())) == 2
    same(tokenize_pairs(pairs, tok, **kw_end), cached_end)


def test_every_input_that_decides_the_ids_is_in_the_key(tok, tmp_path):
    pairs = mixed_pairs()[:4]
    base = dict(max_length=64)
    assert not tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **base)[1]
    assert tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path, **base)[1]

    edited = list(pairs)
    edited[1] = PreferencePair(pairs[1].prompt, " 5", " 8", pairs[1].metadata)  # one character
    other_turn = list(pairs)
    other_turn[0] = PreferencePair(pairs[0].prompt, " 5", " 7", {"example_id": "g2", "turn_id": 3})
    chat_role = list(pairs)
    chat_role[3] = PreferencePair([{**CHAT[0], "role": "user"}, CHAT[1]], "5", "the corner wins")
    variants = [
        (edited, base, None),
        (other_turn, base, None),
        (chat_role, base, None),
        (pairs, dict(max_length=32), None),
        (pairs, dict(base, truncation_mode="keep_end"), None),
        (pairs, dict(base, pair_ids=[0, 1, 2, 7]), None),
    ]
    other_tok = build_tokenizer()
    other_tok.chat_template = other_tok.chat_template.replace("<|end|>", "<|eos|>")
    variants.append((pairs, base, other_tok))
    for i, (ps, kw, t) in enumerate(variants):
        t = t or tok
        result, hit = tokenize_pairs_cached(ps, t, cache_dir=tmp_path, **kw)
        assert not hit, f"variant {i} hit the cache"
        same(tokenize_pairs(ps, t, **kw), result)
    assert len(list(tmp_path.glob("tokens-*.npz"))) == 1 + len(variants)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(build_tokenizer())
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(other_tok)


def test_corrupt_or_foreign_cache_file_is_reported_and_rewritten(tok, tmp_path, caplog):
    pairs = mixed_pairs()[:4]
    tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    for garbage in (b"not a zip file", path.read_bytes()[: path.stat().st_size // 2]):
        path.write_bytes(garbage)
        with caplog.at_level(logging.WARNING, logger="dpojax.data"):
            result, hit = tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path)
        assert not hit
        assert any("unreadable token cache" in r.getMessage() for r in caplog.records)
        same(tokenize_pairs(pairs, tok), result)
        assert tokenize_pairs_cached(pairs, tok, cache_dir=tmp_path)[1]  # rewritten
        caplog.clear()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_no_cache_dir_slow_tokenizer_or_unwritable_dir_still_tokenize(tok, tmp_path, caplog):
    pairs = mixed_pairs()[:4]
    expected = tokenize_pairs(pairs, tok)
    result, hit = tokenize_pairs_cached(pairs, tok, cache_dir=None)
    assert not hit
    same(expected, result)

    class SlowLike:
        """A tokenizer without a Rust backend: its ids cannot be fingerprinted."""

        is_fast = False

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __call__(self, *args, **kwargs):
            return self._inner(*args, **kwargs)

    slow_dir = tmp_path / "slow"
    result, hit = tokenize_pairs_cached(pairs, SlowLike(tok), cache_dir=slow_dir)
    assert not hit and not slow_dir.exists()
    same(expected, result)

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        with caplog.at_level(logging.WARNING, logger="dpojax.data"):
            result, hit = tokenize_pairs_cached(pairs, tok, cache_dir=locked)
        same(expected, result)
        assert any("could not write the token cache" in r.getMessage() for r in caplog.records)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="dpojax.data"):
        result, hit = tokenize_pairs_cached(pairs, tok, cache_dir=blocker / "sub")
    assert not hit
    same(expected, result)
    assert any("could not write the token cache" in r.getMessage() for r in caplog.records)
