"""Pair files: Customizer JSONL (NAT's conversion and 80/20 split), TRL forms, HF datasets, bad input."""

import json
import logging

import pytest

from dpojax.data import (
    TRAINING_FILE,
    VALIDATION_FILE,
    DataError,
    PreferencePair,
    build_pairs,
    customizer_jsonl,
    customizer_record,
    customizer_split,
    import_nat_eval_output,
    pairs_to_records,
    read_pairs,
    write_customizer_files,
    write_pairs,
)

MSGS = [
    {"role": "system", "content": "You play X."},
    {"role": "user", "content": "  1 2 3\n1 _ _ _"},
]
PAIRS = [
    PreferencePair("What is 2+2? ünïcode", "4", "5"),
    PreferencePair(MSGS, "<move>1</move>", "<move>2</move>"),
    PreferencePair(MSGS + [{"role": "assistant", "content": "a"}], "b", "c"),
    PreferencePair([], "x", "y"),
]
STR_PAIRS = [p for p in PAIRS if isinstance(p.prompt, str)] + [PreferencePair("q", "a", "b")]


def triples(pairs):
    return [(p.prompt, p.chosen, p.rejected) for p in pairs]


@pytest.mark.parametrize(
    ("n", "n_train", "n_val"),
    [
        (1, 1, 1),
        (2, 1, 1),
        (3, 2, 1),
        (4, 3, 1),
        (5, 4, 1),
        (7, 5, 2),
        (10, 8, 2),
        (11, 8, 3),
        (199, 159, 40),
    ],
)
def test_customizer_split_rule(n, n_train, n_val):
    items = list(range(n))
    train, val = customizer_split(items)
    assert (len(train), len(val)) == (n_train, n_val)
    assert train == items[:n_train]  # ordered, no shuffle
    assert val == (items[n_train:] or [items[-1]])
    assert n_train == max(1, int(n * 0.8))


def test_customizer_split_single_item_duplicated_and_empty_rejected():
    assert customizer_split(["only"]) == (["only"], ["only"])
    with pytest.raises(ValueError):
        customizer_split([])


def test_customizer_prompt_history_modes():
    s, m, trailing, empty = PAIRS
    assert customizer_record(s) == {
        "prompt": s.prompt,
        "chosen_response": "4",
        "rejected_response": "5",
    }
    assert list(customizer_record(s)) == ["prompt", "chosen_response", "rejected_response"]
    assert customizer_record(m)["prompt"] == "  1 2 3\n1 _ _ _"  # last message's content
    assert customizer_record(trailing)["prompt"] == "a"  # whatever its role
    assert customizer_record(empty)["prompt"] == ""
    full = [customizer_record(p, use_full_message_history=True)["prompt"] for p in PAIRS]
    assert full == [[{"role": "user", "content": s.prompt}], MSGS, trailing.prompt, []]


def test_customizer_files_match_nats_serialisation(tmp_path):
    pairs = [PreferencePair(f"q{i} é", f"good {i}", f"bad {i}") for i in range(7)]
    train_path, val_path = write_customizer_files(pairs, tmp_path / "ds")
    assert train_path == tmp_path / "ds" / TRAINING_FILE
    assert val_path == tmp_path / "ds" / VALIDATION_FILE
    text = train_path.read_text()
    assert not text.endswith("\n") and len(text.split("\n")) == 5
    assert text.split("\n")[0] == (
        '{"prompt": "q0 \\u00e9", "chosen_response": "good 0", "rejected_response": "bad 0"}'
    )
    assert len(val_path.read_text().split("\n")) == 2
    train, _ = read_pairs(tmp_path / "ds")
    val, _ = read_pairs(tmp_path / "ds", split="validation")
    assert triples(train) == triples(pairs[:5]) and triples(val) == triples(pairs[5:])
    one_t, one_v = write_customizer_files(pairs[:1], tmp_path / "one")
    assert one_t.read_text() == one_v.read_text() == customizer_jsonl([customizer_record(pairs[0])])
    with pytest.raises(ValueError, match="No DPO items"):
        write_customizer_files([], tmp_path / "none")
    with pytest.raises(DataError, match="no split 'test'"):
        read_pairs(tmp_path / "ds", split="test")


def test_customizer_round_trip(tmp_path):
    full = write_pairs(
        PAIRS, tmp_path / "full.jsonl", format="customizer", use_full_message_history=True
    )
    back, summary = read_pairs(full)
    assert summary.kept == 4 and not summary.problems
    assert triples(back) == [([{"role": "user", "content": PAIRS[0].prompt}], "4", "5")] + triples(
        PAIRS[1:]
    )
    last = write_pairs(PAIRS, tmp_path / "last.jsonl", format="customizer")
    back, _ = read_pairs(last, format="customizer")
    assert [p.prompt for p in back] == [PAIRS[0].prompt, MSGS[-1]["content"], "a", ""]


@pytest.mark.parametrize("fmt", ["trl", "trl_conversational"])
def test_trl_conversational_round_trip(tmp_path, fmt):
    path = write_pairs(PAIRS, tmp_path / "conv.jsonl", format=fmt, include_metadata=True)
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert first["chosen"] == [{"role": "assistant", "content": "4"}]
    assert first["prompt"] == [{"role": "user", "content": PAIRS[0].prompt}]
    back, _ = read_pairs(path, format="trl", strict=True)
    assert triples(back)[1:] == triples(PAIRS[1:])
    assert back[0].prompt == [{"role": "user", "content": PAIRS[0].prompt}]


def test_trl_plain_round_trip_with_metadata(tmp_path):
    pairs = [
        PreferencePair(p.prompt, p.chosen, p.rejected, {"reward": 1.5, "example_id": "1"})
        for p in STR_PAIRS
    ]
    path = write_pairs(pairs, tmp_path / "plain.jsonl", format="trl", include_metadata=True)
    assert "ünïcode" in path.read_text(encoding="utf-8") and path.read_text().endswith("\n")
    back, _ = read_pairs(path)
    assert back == pairs
    plain, _ = read_pairs(write_pairs(pairs, tmp_path / "p2.jsonl", format="trl_plain"))
    assert triples(plain) == triples(pairs) and plain[0].metadata == {}
    with pytest.raises(ValueError, match="string prompt"):
        write_pairs(PAIRS, tmp_path / "x.jsonl", format="trl_plain")
    with pytest.raises(ValueError, match="format"):
        write_pairs(PAIRS, tmp_path / "x.jsonl", format="csv")
    with pytest.raises(ValueError, match="format"):
        read_pairs(path, format="csv")


def test_auto_detection_per_record_and_explicit_format(write_lines):
    path = write_lines(
        [
            json.dumps({"prompt": "a", "chosen_response": "x", "rejected_response": "y"}),
            json.dumps({"prompt": "b", "chosen": "x", "rejected": "y", "other": 1}),
        ]
    )
    pairs, _ = read_pairs(path)
    assert triples(pairs) == [("a", "x", "y"), ("b", "x", "y")]
    pairs, summary = read_pairs(path, format="customizer")
    assert triples(pairs) == [("a", "x", "y")]
    assert [str(p) for p in summary.problems] == [f"{path}:2: missing field 'chosen_response'"]
    pairs, summary = read_pairs(path, format="trl")
    assert [str(p) for p in summary.problems] == [f"{path}:1: missing field 'chosen'"]


def test_json_array_file(tmp_path):
    records = pairs_to_records(STR_PAIRS, "trl")
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(records, indent=2))
    back, _ = read_pairs(path)
    assert triples(back) == triples(STR_PAIRS)
    records[1]["chosen"] = ""
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]")
    back, summary = read_pairs(path)
    assert len(back) == 1 and summary.records == 2
    assert [str(p) for p in summary.problems] == [f"{path}:3: 'chosen' is empty"]
    lines_path = tmp_path / "lines.json"  # .json holding JSON lines, as HF's json loader allows
    lines_path.write_text("\n".join(json.dumps(r) for r in records))
    assert len(read_pairs(lines_path)[0]) == 1


def test_hf_dataset_dirs_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    conv = datasets.Dataset.from_list(pairs_to_records(PAIRS[1:], "trl_conversational"))
    conv.save_to_disk(str(tmp_path / "conv"))
    back, _ = read_pairs(tmp_path / "conv", strict=True)
    assert triples(back) == triples(PAIRS[1:])

    plain = datasets.Dataset.from_list(pairs_to_records(STR_PAIRS, "customizer"))
    dd = datasets.DatasetDict({"train": plain, "test": plain.select([0])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert triples(read_pairs(tmp_path / "dd")[0]) == triples(STR_PAIRS)
    assert triples(read_pairs(tmp_path / "dd", split="test")[0]) == triples(STR_PAIRS[:1])
    with pytest.raises(DataError, match="no split 'validation'; available: train, test"):
        read_pairs(tmp_path / "dd", split="validation")

    plain.to_parquet(str(tmp_path / "pairs.parquet"))
    assert triples(read_pairs(tmp_path / "pairs.parquet")[0]) == triples(STR_PAIRS)

    bad = datasets.Dataset.from_list(
        [
            {"prompt": "p", "chosen": "same", "rejected": "same"},
            {"prompt": "p", "chosen": "a", "rejected": "b"},
            {"prompt": "p", "chosen": "a", "rejected": None},
        ]
    )
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    pairs, summary = read_pairs(tmp_path / "bad.parquet")
    assert len(pairs) == 1
    assert [str(p) for p in summary.problems] == [
        f"{tmp_path / 'bad.parquet'}:row 1: 'chosen' and 'rejected' are identical",
        f"{tmp_path / 'bad.parquet'}:row 3: 'rejected' must be a string or a list of messages, "
        "got null",
    ]


def test_unreadable_sources(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_pairs(tmp_path / "missing.jsonl")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="neither a datasets.save_to_disk folder"):
        read_pairs(tmp_path / "empty_dir")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read dataset"):
        read_pairs(broken)
    array = tmp_path / "broken.json"
    array.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    with pytest.raises(DataError, match=rf"^{array}:3: malformed JSON"):
        read_pairs(array)


GOOD = {"prompt": "p", "chosen": "a", "rejected": "b"}
BAD_RECORDS = [
    (
        '{"prompt": "p", "chosen": "a"',
        "malformed_json",
        "malformed JSON: Expecting ',' delimiter (column 30)",
    ),
    ('"just a string"', "not_an_object", "expected a JSON object, got string"),
    (
        {"chosen": "a", "rejected": "b"},
        "no_shared_prompt",
        "no 'prompt' field, and 'chosen' and 'rejected' share no leading part to use as one",
    ),
    ({"prompt": "p", "chosen": "a"}, "missing_field", "missing field 'rejected'"),
    (
        {"prompt": "p", "answer": "a"},
        "missing_field",
        "missing fields: expected 'chosen'/'rejected'"
        " (TRL) or 'chosen_response'/'rejected_response' (Customizer)",
    ),
    (
        {**GOOD, "chosen": 4},
        "wrong_type",
        "'chosen' must be a string or a list of messages, got number",
    ),
    (
        {**GOOD, "prompt": {"role": "user"}},
        "wrong_type",
        "'prompt' must be a string or a list of messages, got object",
    ),
    (
        {**GOOD, "prompt": [{"role": "user", "content": 1}]},
        "wrong_type",
        "'prompt[0].content' must be a string, a list or null",
    ),
    (
        {**GOOD, "prompt": [{"content": "hi"}]},
        "wrong_type",
        "'prompt[0]' must be an object with a string 'role'",
    ),
    (
        {**GOOD, "chosen": [{"role": "assistant", "content": "a"}]},
        "wrong_type",
        "'chosen' and 'rejected' must both be text or both messages",
    ),
    ({**GOOD, "chosen": ""}, "empty_completion", "'chosen' is empty"),
    (
        {**GOOD, "rejected": [{"role": "assistant", "content": "  "}]},
        "empty_completion",
        "'rejected' is empty",
    ),
    (
        {"prompt": "p", "chosen_response": "\n", "rejected_response": "b"},
        "empty_completion",
        "'chosen_response' is empty",
    ),
    ({**GOOD, "rejected": "a"}, "chosen_equals_rejected", "'chosen' and 'rejected' are identical"),
    (
        {"prompt": "p", "chosen_response": "z", "rejected_response": "z"},
        "chosen_equals_rejected",
        "'chosen_response' and 'rejected_response' are identical",
    ),
    ({**GOOD, "metadata": "x"}, "wrong_type", "'metadata' must be an object or null, got string"),
    (
        b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}',
        "invalid_utf8",
        "bytes are not valid UTF-8 (byte 0xe9 at column 16)",
    ),
]


@pytest.mark.parametrize(("bad", "code", "reason"), BAD_RECORDS)
def test_bad_record_skipped_and_reported(write_lines, bad, code, reason):
    bad_line = bad if isinstance(bad, str | bytes) else json.dumps(bad)
    path = write_lines([json.dumps(GOOD), json.dumps(GOOD), bad_line, json.dumps(GOOD)])
    pairs, summary = read_pairs(path)
    assert len(pairs) == 3 and summary.records == 4 and summary.skipped == {code: 1}
    assert [str(p) for p in summary.problems] == [f"{path}:3: {reason}"]
    with pytest.raises(DataError) as info:
        read_pairs(path, strict=True)
    assert str(info.value) == f"{path}:3: {reason}"


def test_strict_lists_every_problem_default_logs_once(write_lines, caplog):
    path = write_lines(
        [
            json.dumps(GOOD),
            "{bad",
            json.dumps({**GOOD, "chosen": "b"}),
            "",
            json.dumps({**GOOD, "rejected": 1}),
            b"\x80",
        ]
    )
    with pytest.raises(DataError) as info:
        read_pairs(path, strict=True)
    assert str(info.value).splitlines() == [
        "4 problems in input data:",
        f"{path}:2: malformed JSON: Expecting property name enclosed in double quotes (column 2)",
        f"{path}:3: 'chosen' and 'rejected' are identical",
        f"{path}:5: 'rejected' must be a string or a list of messages, got number",
        f"{path}:6: bytes are not valid UTF-8 (byte 0x80 at column 1)",
    ]
    with caplog.at_level(logging.WARNING, logger="dpojax.data"):
        pairs, summary = read_pairs(path)
    assert len(pairs) == 1 and summary.num_skipped == 4 and len(caplog.records) == 1
    assert summary.skipped == {
        "malformed_json": 1,
        "chosen_equals_rejected": 1,
        "wrong_type": 1,
        "invalid_utf8": 1,
    }
    assert "5 records, 1 kept, 4 skipped" in str(summary)


def test_nat_sample_to_customizer_files(nat_sample, tmp_path):
    events, _ = import_nat_eval_output(nat_sample[0])
    pairs = build_pairs(events).pairs
    train, val = write_customizer_files(pairs, tmp_path, use_full_message_history=True)
    read_train, _ = read_pairs(tmp_path, strict=True)
    read_val, _ = read_pairs(tmp_path, split="validation", strict=True)
    assert len(read_train) == 14 and len(read_val) == 4  # k = max(1, int(18 * 0.8)) = 14
    assert triples(read_train + read_val) == triples(pairs)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_wide_encodings_are_named_not_reported_as_malformed_json(tmp_path, encoding, suffix):
    """Before: a UTF-16 file (as Windows tools write) was reported line by line as malformed
    JSON or invalid UTF-8, without naming the encoding."""
    path = tmp_path / f"pairs{suffix}"
    text = json.dumps(GOOD) + "\n" if suffix == ".jsonl" else json.dumps([GOOD])
    path.write_bytes(text.encode(encoding))
    with pytest.raises(DataError) as info:
        read_pairs(path)
    message = str(info.value)
    assert str(path) in message and "UTF-" in message and "iconv" in message
    assert "malformed JSON" not in message


def test_a_key_given_twice_is_a_bad_record_naming_the_key(tmp_path):
    good = '{"prompt": "q", "chosen": "a", "rejected": "b"}'
    twice = '{"prompt": "q", "chosen": "a", "rejected": "b", "chosen": "b2"}'
    nested = (
        '{"prompt": [{"role": "user", "role": "system", "content": "q"}], '
        '"chosen": [{"role": "assistant", "content": "a"}], '
        '"rejected": [{"role": "assistant", "content": "b"}]}'
    )
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join([good, twice, nested]) + "\n")
    pairs, summary = read_pairs(path)
    assert triples(pairs) == [("q", "a", "b")]
    assert summary.skipped == {"duplicate_key": 2} and summary.records == 3
    assert [str(p) for p in summary.problems] == [
        f"{path}:2: key 'chosen' appears more than once in one object (which value is meant "
        "is unknown): keep one",
        f"{path}:3: key 'prompt[0].role' appears more than once in one object (which value is "
        "meant is unknown): keep one",
    ]
    with pytest.raises(DataError, match=r"pairs.jsonl:2: key 'chosen' appears more than once"):
        read_pairs(path, strict=True)
    array = tmp_path / "pairs.json"
    array.write_text("[\n" + ",\n".join([good, twice]) + "\n]")
    pairs, summary = read_pairs(array)
    assert len(pairs) == 1 and [p.line for p in summary.problems] == [3]
    assert summary.problems[0].code == "duplicate_key"
