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


def test_unpaired_losses_read_unpaired_records_or_unpair_pairs(tmp_path, tok):
    """kto: records with a label are unpaired examples; a paired source (no label column) is
    unpaired as TRL does (per run of pairs: every chosen, then every rejected), with data.format
    auto or trl; each example carries its label and its KL completion (rotated in runs of one
    micro-batch)."""
    c = default_config()
    c.loss.type = "kto"
    c.train.batch_size, c.train.grad_accum = 4, 2  # KL runs of 2
    rows = [{"prompt": f"Say {i}:", "completion": f" {i}", "label": i % 2 == 0} for i in range(4)]
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = build.load_pairs(c, str(unpaired), tok)
    assert [p.label for p in got] == [1, 0, 1, 0]
    own = [p.sequence("chosen")[p.chosen_prompt_len :].tolist() for p in got]
    kl = [p.sequence("rejected")[p.rejected_prompt_len :].tolist() for p in got]
    assert kl == [own[1], own[0], own[3], own[2]]
    pairs = _write(tmp_path / "pairs.jsonl", 5)  # 4 good pairs
    c.data.columns.prompt, c.data.columns.chosen, c.data.columns.rejected = "q", "good", "bad"
    for fmt in ("auto", "trl"):
        c.data.format = fmt
        got = build.load_pairs(c, str(pairs), tok)
        assert [p.label for p in got] == [1] * 4 + [0] * 4
        assert [p.pair_id for p in got] == list(range(8))
