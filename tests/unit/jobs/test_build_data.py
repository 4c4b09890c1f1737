"""How a run's config picks and reads its data: train / eval sources and splits, column mapping,
and streamed reading (tokenized in chunks) giving the same pairs as the prepared dataset."""

from __future__ import annotations

import json

import pytest

from dpojax.config import default_config
from dpojax.data.problems import DataError
from dpojax.jobs import build
from dpojax.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _write(path, n):
    rows = [{"q": f"Say {i}:", "good": f" {i}", "bad": f" {i + 1}"} for i in range(n)]
    rows[3]["bad"] = rows[3]["good"]  # one bad record
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_source_follows_the_config():
    c = default_config()
    c.data.train_path = "org/prefs"
    assert build.eval_source(c, train=True) is None
    c.data.eval_split = "test"
    assert build.eval_source(c, train=True) == ("org/prefs", "test")
    c.data.eval_path = "val.jsonl"
    assert build.eval_source(c, train=True) == ("val.jsonl", "test")
    c.data.eval_path, c.data.eval_split, c.data.train_split = "", "", "train[:10]"
    assert build.eval_source(c, train=False) == ("org/prefs", "train[:10]")  # evaluate mode


def test_streamed_pairs_equal_prepared_pairs(tmp_path, tok, monkeypatch):
    path = _write(tmp_path / "pairs.jsonl", 11)
    c = default_config()
    c.data.columns.prompt, c.data.columns.chosen, c.data.columns.rejected = "q", "good", "bad"
    prepared = build.load_pairs(c, str(path), tok)
    c.data.streaming = True
    real = build._streamed_pairs
    monkeypatch.setattr(
        build, "_streamed_pairs", lambda *a, **k: real(*a, **{**k, "chunk": 4})
    )  # several chunks
    streamed = build.load_pairs(c, str(path), tok)
    assert len(prepared) == len(streamed) == 10
    for a, b in zip(prepared, streamed, strict=True):
        assert a.pair_id == b.pair_id
        assert a.sequence("chosen").tolist() == b.sequence("chosen").tolist()
        assert a.completion_mask("rejected").tolist() == b.completion_mask("rejected").tolist()
    assert [p.pair_id for p in streamed] == list(range(10))  # the kept pairs, in order
    c.data.strict = True
    with pytest.raises(DataError, match=r"row 4: 'chosen' and 'rejected' are identical"):
        build.load_pairs(c, str(path), tok)
