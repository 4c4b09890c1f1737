"""Unpaired examples (dpojax.data.unpaired): TRL unpaired records, unpairing pairs, and TTC events
labelled by a score threshold or top/bottom k, deduplicated."""

import json

import pytest

from dpojax.data.events import TTCEvent
from dpojax.data.pairs import PreferencePair
from dpojax.data.problems import DataError
from dpojax.data.unpaired import (
    UnpairedExample,
    build_unpaired,
    dedup_unpaired,
    read_unpaired,
    unpair,
    unpaired_from_record,
)


def _event(example, turn, index, score, output=None, prompt="p", name="dpo_candidate_move"):
    return TTCEvent(
        example_id=str(example),
        turn_id=str(turn),
        candidate_index=index,
        input=prompt,
        output=output or f"{example}-{turn}-{index}",
        score=score,
        name=name,
    )


EVENTS = [
    _event(1, "a", 0, 0.9),
    _event(1, "a", 1, 0.2),
    _event(1, "a", 2, 0.5),
    _event(1, "b", 0, 0.7),  # a single-candidate turn
    _event(2, "a", 0, 0.1),  # another single-candidate turn
    _event(2, "c", 0, 0.8),
    _event(2, "c", 1, 0.8),  # tied with the candidate above
    _event(2, "c", 2, 0.3, name="other_step"),  # filtered by the step name
]


def test_threshold_labels_every_candidate_single_candidate_turns_included():
    result = build_unpaired(EVENTS, threshold=0.5)
    labels = {e.completion: e.label for e in result.examples}
    assert labels == {
        "1-a-0": True, "1-a-1": False, "1-a-2": True, "1-b-0": True, "2-a-0": False,
        "2-c-0": True, "2-c-1": True,
    }  # fmt: skip
    s = result.stats
    assert (s.desirable, s.undesirable, s.total_candidates) == (5, 2, 7)
    assert (s.decision_points, s.single_candidate, s.unlabelled) == (4, 2, 0)
    assert [e.completion for e in result.examples][:3] == ["1-a-0", "1-a-1", "1-a-2"]
    meta = result.examples[0].metadata
    assert meta["example_id"] == "1" and meta["score"] == 0.9 and meta["num_candidates"] == 3
    assert "5 desirable and 2 undesirable" in str(s)


def test_threshold_is_inclusive_and_moves_the_counts():
    assert build_unpaired(EVENTS, threshold=0.8).stats.desirable == 3  # 0.9, 0.8, 0.8
    assert build_unpaired(EVENTS, threshold=0.81).stats.desirable == 1
    assert build_unpaired(EVENTS, threshold=0.0).stats.undesirable == 0
    assert build_unpaired(EVENTS, threshold=1.0).stats.desirable == 0


def test_top_k_per_decision_point():
    result = build_unpaired(EVENTS, top_k=1)
    labels = {e.completion: e.label for e in result.examples}
    # turn 1::a: best 0.9 desirable, worst 0.2 undesirable, 0.5 unlabelled; 2::c: the two tied
    # candidates: the first ranked is desirable, the tie is not made undesirable.
    assert labels == {"1-a-0": True, "1-a-1": False, "2-c-0": True}
    s = result.stats
    assert (s.desirable, s.undesirable, s.single_candidate) == (2, 1, 2)
    assert s.unlabelled == 4  # 1-a-2, the tie 2-c-1, and the two single candidates
    both = build_unpaired(EVENTS, top_k=2)  # 1::a: top 2 (0.9, 0.5), bottom of the rest (0.2)
    assert {e.completion: e.label for e in both.examples}["1-a-2"] is True
    assert (both.stats.desirable, both.stats.undesirable) == (4, 1)


def test_decision_points_split_by_input():
    """Candidates of one decision point share their prompt: a turn with two inputs is two."""
    events = [_event(1, "a", 0, 0.9, prompt="x"), _event(1, "a", 1, 0.1, prompt="y")]
    result = build_unpaired(events, top_k=1)
    assert result.stats.mixed_input_turns == 1 and result.stats.decision_points == 2
    assert result.examples == [] and result.stats.single_candidate == 2


def test_dedup_keeps_the_first_and_drops_contradictions():
    events = [
        _event(1, "a", 0, 0.9, output="same"),
        _event(2, "a", 0, 0.8, output="same"),  # same prompt and completion, same label
        _event(3, "a", 0, 0.9, output="torn"),
        _event(4, "a", 0, 0.1, output="torn"),  # same again, the other label
        _event(5, "a", 0, 0.1, output="bad"),
        _event(6, "a", 0, 0.2, output="bad", prompt="q"),  # another prompt: not a duplicate
    ]
    result = build_unpaired(events, threshold=0.5)
    assert [(e.completion, e.label) for e in result.examples] == [
        ("same", True), ("bad", False), ("bad", False),
    ]  # fmt: skip
    assert result.examples[0].metadata["example_id"] == "1"
    s = result.stats
    assert (s.duplicates, s.conflicting, s.desirable, s.undesirable) == (1, 1, 1, 2)


def test_dedup_counts_tools_and_messages():
    msgs = [{"role": "user", "content": "hi"}]
    a = UnpairedExample(msgs, "yes", True)
    b = UnpairedExample([dict(msgs[0])], "yes", True, tools=[{"name": "f"}])
    kept, duplicates, conflicting = dedup_unpaired([a, UnpairedExample(msgs, "yes", True), b])
    assert kept == [a, b] and (duplicates, conflicting) == (1, 0)


def test_build_refuses_unclear_options():
    with pytest.raises(ValueError, match="exactly one"):
        build_unpaired(EVENTS)
    with pytest.raises(ValueError, match="exactly one"):
        build_unpaired(EVENTS, threshold=0.5, top_k=1)
    with pytest.raises(ValueError, match="top_k must be"):
        build_unpaired(EVENTS, top_k=0)


RECORDS = [
    {"prompt": "The sky is", "completion": " blue.", "label": True},
    {"prompt": "The sky is", "completion": " green.", "label": False},
    {
        "prompt": [{"role": "user", "content": "Hi"}],
        "completion": [{"role": "assistant", "content": "Hello!"}],
        "label": True,
        "metadata": {"source": "chat"},
    },
    {
        "prompt": "Weather?",
        "completion": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
        "label": False,
        "tools": json.dumps([{"type": "function"}]),
    },
]


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_reads_plain_and_conversational_records(tmp_path):
    examples, summary = read_unpaired(_write(tmp_path, RECORDS), strict=True)
    assert summary.kept == 4 and [e.label for e in examples] == [True, False, True, False]
    assert examples[0] == UnpairedExample("The sky is", " blue.", True)
    assert examples[2].completion == "Hello!"  # one plain assistant turn becomes its text
    assert examples[2].prompt == [{"role": "user", "content": "Hi"}] and examples[2].metadata
    assert examples[3].prompt == [{"role": "user", "content": "Weather?"}]
    assert examples[3].tools == [{"type": "function"}] and examples[3].conversational
    assert examples[1].to_dict()["label"] is False


def test_column_mapping_and_system_prompt(tmp_path):
    records = [{"q": [{"role": "user", "content": "Hi"}], "a": "Yo", "good": False}]
    path = _write(tmp_path, records)
    columns = {"prompt": "q", "completion": "a", "label": "good"}
    (example,), _ = read_unpaired(path, columns=columns, system_prompt="Be brief.", strict=True)
    assert example.prompt[0] == {"role": "system", "content": "Be brief."}
    assert example.label is False
    with pytest.raises(ValueError, match=r"unknown unpaired column names \['chosen'\]"):
        read_unpaired(path, columns={"chosen": "a"})


def test_bad_records_name_the_file_and_line(tmp_path):
    lines = [
        RECORDS[0],
        {"prompt": "x", "completion": "y", "label": 2},
        {"prompt": "x", "completion": "  ", "label": True},
        {"prompt": "x", "chosen": "a", "rejected": "b"},
        {"completion": "y", "label": True},
        ["not", "an", "object"],
    ]
    path = _write(tmp_path, lines)
    examples, summary = read_unpaired(path)
    assert len(examples) == 1 and summary.kept == 1 and summary.num_skipped == 5
    with pytest.raises(DataError) as info:
        read_unpaired(path, strict=True)
    text = str(info.value)
    assert f"{path}:2: 'label' must be true (desirable) or false (undesirable), got number" in text
    assert f"{path}:3: 'completion' is empty" in text
    assert "looks like a preference pair (read it with read_pairs, then unpair)" in text
    assert f"{path}:5: missing field 'prompt'" in text
    assert f"{path}:6: expected a JSON object" in text


def test_unpaired_from_record_types():
    with pytest.raises(Exception, match="'prompt' must be a string or a list of messages"):
        unpaired_from_record({"prompt": 3, "completion": "y", "label": True})
    example = unpaired_from_record({"prompt": [], "completion": "y", "label": True})
    assert example.prompt == []
    assert unpaired_from_record({"prompt": "x", "completion": "y", "label": 0}).label is False
    with pytest.raises(Exception, match="'label' must be true"):
        unpaired_from_record({"prompt": "x", "completion": "y", "label": "yes"})


def test_unpair_follows_trl_order():
    """TRL's unpair_preference_dataset: per batch of 1,000 pairs, the chosen, then the rejected."""
    pairs = [PreferencePair(f"p{i}", f"c{i}", f"r{i}", {"i": i}) for i in range(1001)]
    examples = unpair(pairs)
    assert len(examples) == 2002
    assert [e.completion for e in examples[999:1001]] == ["c999", "r0"]
    assert examples[1999].completion == "r999" and examples[2000].completion == "c1000"
    assert [e.label for e in examples[2000:]] == [True, False]
    assert examples[0].prompt == "p0" and examples[0].metadata == {"i": 0}


def test_dataset_sources_as_pairs_have_them(tmp_path):
    """The readers of pairs: a dataset repository of parquet splits (conversational records, as
    trl-lib/kto-mix-14k holds them) and a save_to_disk folder; row numbers in the problems."""
    datasets = pytest.importorskip("datasets")
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Question {i}?"}],
            "completion": [{"role": "assistant", "content": f"Answer {i}."}],
            "label": i % 2 == 0,
        }
        for i in range(5)
    ]
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows[:3]).to_parquet(str(repo / "data" / "train-0.parquet"))
    datasets.Dataset.from_list(rows[3:]).to_parquet(str(repo / "data" / "test-0.parquet"))
    train, summary = read_unpaired(repo, split="train", strict=True)
    assert [(e.completion, e.label) for e in train] == [
        ("Answer 0.", True), ("Answer 1.", False), ("Answer 2.", True),
    ]  # fmt: skip
    assert summary.kept == 3
    test, _ = read_unpaired(repo, split="test")
    assert [e.prompt[0]["content"] for e in test] == ["Question 3?", "Question 4?"]

    plain = [{"q": "a", "c": " b", "l": True}, {"q": "a", "c": " ", "l": False}]
    datasets.Dataset.from_list(plain).save_to_disk(str(tmp_path / "disk"))
    columns = {"prompt": "q", "completion": "c", "label": "l"}
    examples, summary = read_unpaired(tmp_path / "disk", columns=columns)
    assert len(examples) == 1
    assert [str(p) for p in summary.problems] == [f"{tmp_path / 'disk'}:row 2: 'c' is empty"]
