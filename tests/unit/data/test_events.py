"""TTC event JSONL: round trips, defaults, and every kind of bad line reported as file:line."""

import json
import logging

import pytest

from dpojax.data import DataError, TTCEvent, read_events, write_events

GOOD = {"example_id": "e1", "turn_id": "t1", "input": "p", "output": "a", "score": 1.0}


def line(**changes) -> str:
    obj = {**GOOD, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


def test_round_trip(tmp_path):
    events = [
        TTCEvent(
            example_id="1",
            turn_id="turn_0_ab",
            turn_index=0,
            candidate_index=2,
            input=[{"role": "system", "content": "sys"}, {"role": "user", "content": "böard"}],
            output="<move>\n  <row>1</row>\n</move>",
            score=10.6,
            name="dpo_candidate_move",
            metadata={"move_id": "x", "is_selected": True},
        ),
        TTCEvent(example_id="2", turn_id="t", input="plain ✓", output="out", score=-3.0),
    ]
    path = write_events(events, tmp_path / "events.jsonl")
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and text.count("\n") == 2 and "✓" in text
    assert "metadata" not in json.loads(text.splitlines()[1])
    back, summary = read_events(path)
    assert back == events
    assert (summary.records, summary.kept, summary.num_skipped) == (2, 2, 0)


def test_defaults_and_id_coercion(write_lines):
    path = write_lines(
        [
            json.dumps(
                {
                    "example_id": 7,
                    "turn_id": 3,
                    "input": [],
                    "output": "a",
                    "score": 2,
                    "candidate_index": None,
                    "extra": 1,
                }
            )
        ]
    )
    (event,), _ = read_events(path)
    assert event == TTCEvent(example_id="7", turn_id="3", input=[], output="a", score=2.0)
    assert event.name == "dpo_candidate_move" and event.candidate_index == 0
    assert event.turn_index is None and isinstance(event.score, float)


def test_messages_drop_extra_keys(write_lines):
    msgs = [{"role": "assistant", "content": "x", "tool_calls": []}]
    (event,), _ = read_events(write_lines([line(input=msgs)]))
    assert event.input == [{"role": "assistant", "content": "x"}]


BAD_LINES = [
    (
        '{"example_id": "e1",',
        "malformed_json",
        "malformed JSON: Expecting property name enclosed in double quotes (column 21)",
    ),
    ("[1, 2]", "not_an_object", "expected a JSON object, got array"),
    (line(score=...), "missing_field", "missing field 'score'"),
    (line(output=...), "missing_field", "missing field 'output'"),
    (line(score="high"), "wrong_type", "'score' must be a number, got string"),
    (line(score=True), "wrong_type", "'score' must be a number, got boolean"),
    (line(score=float("nan")), "non_finite_score", "'score' is not finite (nan)"),
    (line(score=float("inf")), "non_finite_score", "'score' is not finite (inf)"),
    (line(score=float("-inf")), "non_finite_score", "'score' is not finite (-inf)"),
    (line(output=""), "empty_completion", "'output' is empty"),
    (line(output=" \n"), "empty_completion", "'output' is empty"),
    (line(output=3), "wrong_type", "'output' must be a string, got number"),
    (line(input=5), "wrong_type", "'input' must be a string or a list of messages, got number"),
    (
        line(input=[{"role": "user", "content": "a"}, {"role": "user"}]),
        "wrong_type",
        "'input[1]' must be an object with string 'role' and 'content'",
    ),
    (line(example_id=[1]), "wrong_type", "'example_id' must be a string or an integer, got array"),
    (line(turn_index="0"), "wrong_type", "'turn_index' must be an integer or null, got string"),
    (line(name=None), "wrong_type", "'name' must be a string, got null"),
    (line(metadata=[]), "wrong_type", "'metadata' must be an object or null, got array"),
    (
        b'{"example_id": "\xff\xfe"}',
        "invalid_utf8",
        "bytes are not valid UTF-8 (byte 0xff at column 17)",
    ),
]


@pytest.mark.parametrize(("bad", "code", "reason"), BAD_LINES)
def test_bad_line_skipped_and_reported(write_lines, bad, code, reason):
    path = write_lines([line(), bad, line(turn_id="t2")])
    events, summary = read_events(path)
    assert [e.turn_id for e in events] == ["t1", "t2"]
    assert summary.skipped == {code: 1} and summary.kept == 2 and summary.records == 3
    (problem,) = summary.problems
    assert str(problem) == f"{path}:2: {reason}"
    with pytest.raises(DataError) as info:
        read_events(path, strict=True)
    assert str(info.value) == f"{path}:2: {reason}"


def test_strict_lists_every_problem_and_default_logs_once(write_lines, caplog):
    path = write_lines([line(), "", "{oops", line(score=float("nan")), "  ", line(output="")])
    with pytest.raises(DataError) as info:
        read_events(path, strict=True)
    assert str(info.value).splitlines() == [
        "3 problems in input data:",
        f"{path}:3: malformed JSON: Expecting property name enclosed in double quotes (column 2)",
        f"{path}:4: 'score' is not finite (nan)",
        f"{path}:6: 'output' is empty",
    ]
    assert len(info.value.problems) == 3
    with caplog.at_level(logging.WARNING, logger="dpojax.data"):
        events, summary = read_events(path)
    assert len(events) == 1 and summary.num_skipped == 3
    assert summary.skipped == {"malformed_json": 1, "non_finite_score": 1, "empty_completion": 1}
    assert len(caplog.records) == 1 and "3 skipped" in caplog.records[0].getMessage()


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_events(tmp_path / "nope.jsonl")


def test_write_rejects_nan(tmp_path):
    bad = TTCEvent(example_id="e", turn_id="t", input="p", output="o", score=float("nan"))
    with pytest.raises(ValueError):
        write_events([bad], tmp_path / "x.jsonl")


def test_an_event_giving_a_key_twice_is_skipped(write_lines):
    twice = line()[:-1] + ', "score": 0.0}'  # the score given twice: which one is meant?
    path = write_lines([line(), twice])
    events, summary = read_events(path)
    assert len(events) == 1 and summary.skipped == {"duplicate_key": 1}
    assert str(summary.problems[0]).startswith(f"{path}:2: key 'score' appears more than once")
