"""Importing TTC events from NAT evaluation output: the real sample, NAT's parsing rules, bad steps."""

import json

import pytest

from dpojax.data import DataError, import_nat_eval_output, read_events, write_events


def step(event_type="TTC_END", name="dpo_candidate_move", metadata=None, **data):
    """One dumped IntermediateStep on a single JSON line."""
    base = {
        "turn_id": "t0",
        "turn_index": 0,
        "candidate_index": 0,
        "input": "board",
        "output": "move",
        "score": 1.0,
    }
    payload = {
        "event_type": event_type,
        "name": name,
        "metadata": metadata,
        "data": {**base, **data},
    }
    return json.dumps({"parent_id": "root", "payload": payload})


def nat_file(tmp_path, items):
    """Write items ({id: [step lines]}) one step per line; returns (path, {(item, step): line})."""
    lines, where = ["["], {}
    for i, (item_id, steps) in enumerate(items):
        lines.append(json.dumps({"id": item_id})[:-1] + ', "intermediate_steps": [')
        for j, text in enumerate(steps):
            lines.append(text + ("," if j < len(steps) - 1 else ""))
            where[(i, j)] = len(lines)
        lines.append("]}" + ("," if i < len(items) - 1 else ""))
    lines.append("]")
    path = tmp_path / "workflow_output.json"
    path.write_text("\n".join(lines))
    return path, where


def test_real_sample(nat_sample, tmp_path):
    sample, _ = nat_sample
    events, summary = import_nat_eval_output(sample)
    assert len(events) == 18 and not summary.problems and summary.records == 18
    first = events[0]
    assert (first.example_id, first.turn_id, first.turn_index, first.candidate_index) == (
        "1",
        "turn_0_5bc8fbbc",
        0,
        0,
    )
    assert first.input == [
        {"role": "system", "content": "You are an expert tic-tac-toe player playing as 'X'."},
        {"role": "user", "content": "  1 2 3\n1 _ _ _\n2 _ _ _\n3 _ _ _"},
    ]
    assert first.output == "<move>\n  <row>3</row>\n  <col>3</col>\n</move>"
    assert first.score == 10.6 and first.name == "dpo_candidate_move"
    assert first.metadata == {
        "move_id": "turn_0_5bc8fbbc_move_0",
        "is_selected": True,
        "player_symbol": "X",
    }
    assert [e.example_id for e in events] == ["1"] * 6 + ["2"] * 6 + ["3"] * 6
    assert [e.candidate_index for e in events] == [0, 1, 2] * 6
    back, _ = read_events(write_events(events, tmp_path / "events.jsonl"))
    assert back == events


def test_layouts_and_name_filter(tmp_path):
    payload = json.loads(step())["payload"]
    other = {**payload, "name": "other_step"}
    start = {**payload, "event_type": "TTC_START"}
    for doc in (
        {"eval_input": {"eval_input_items": [{"id": "a", "trajectory": [payload, other, start]}]}},
        {"eval_input_items": [{"id": "a", "trajectory": [{"payload": payload}, other]}]},
    ):
        path = tmp_path / "out.json"
        path.write_text(json.dumps(doc))
        events, _ = import_nat_eval_output(path)
        assert [e.name for e in events] == ["dpo_candidate_move", "other_step"]
        only, _ = import_nat_eval_output(path, ttc_step_name="dpo_candidate_move")
        assert [e.name for e in only] == ["dpo_candidate_move"]


def test_nat_parsing_rules(tmp_path):
    weird_input = [{"role": "user", "content": "hi"}, {"role": "tool", "content": None}]
    path, where = nat_file(
        tmp_path,
        [
            (
                5,
                [
                    step(candidate_index=None, input=None, output="a", metadata={"k": 1}),
                    step(candidate_index=1, input=weird_input, output="b", score=2),
                    step(candidate_index=2, input={"x": 1}, output=7, score=0.5),
                    step(event_type="TTC_START", score=None, output=None),
                    step(event_type="LLM_END", name="llm", turn_id=None),
                ],
            ),
        ],
    )
    events, summary = import_nat_eval_output(path)
    assert [(e.candidate_index, e.input, e.output, e.score) for e in events] == [
        (0, "", "a", 1.0),
        (1, str(weird_input), "b", 2.0),  # NAT: the whole input becomes its Python repr
        (2, "{'x': 1}", "7", 0.5),
    ]
    assert events[0].metadata == {"k": 1} and events[1].metadata == {}
    assert all(e.example_id == "5" for e in events)
    assert summary.num_skipped == 0 and summary.kept == 3
    assert summary.flagged == {"input_not_messages": 2, "output_not_string": 1}
    assert str(summary.problems[0]).startswith(f"{path}:{where[(0, 1)]}: item 0 step 1: input is")
    with pytest.raises(DataError):  # flagged records fail strict mode too
        import_nat_eval_output(path, strict=True)


def test_duplicate_ids_keep_last_at_first_position(tmp_path):
    path, where = nat_file(
        tmp_path,
        [
            (1, [step(output="first")]),
            (2, [step(output="second")]),
            (1, [step(output="third")]),
        ],
    )
    events, summary = import_nat_eval_output(path)
    assert [(e.example_id, e.output) for e in events] == [("1", "third"), ("2", "second")]
    assert summary.skipped == {"duplicate_example_id": 1}
    assert str(summary.problems[0]).startswith(f"{path}:2: item 0: duplicate eval item id 1")


BAD_STEPS = [
    (step(score=None), "missing_field", "'score' is missing or null"),
    (step(turn_id=None), "missing_field", "'turn_id' is missing or null"),
    (step(turn_id=3), "wrong_type", "'turn_id' must be a string, got number"),
    (step(score="x"), "wrong_type", "'score' must be a number, got string"),
    (step(score=float("nan")), "non_finite_score", "'score' is not finite (nan)"),
    (step(score=float("-inf")), "non_finite_score", "'score' is not finite (-inf)"),
    (step(output=None), "empty_completion", "'output' is empty"),
    (step(output=""), "empty_completion", "'output' is empty"),
    (step(candidate_index="a"), "wrong_type", "'candidate_index' must be an integer or null"),
    (
        json.dumps(
            {"payload": {"event_type": "TTC_END", "name": "dpo_candidate_move", "data": None}}
        ),
        "missing_field",
        "TTC_END step has no data",
    ),
    (
        json.dumps(
            {"payload": {"event_type": "TTC_END", "name": "dpo_candidate_move", "data": "x"}}
        ),
        "wrong_type",
        "step data must be an object",
    ),
]


@pytest.mark.parametrize(("bad", "code", "reason"), BAD_STEPS)
def test_bad_step_reported_with_line(tmp_path, bad, code, reason):
    path, where = nat_file(tmp_path, [("a", [step(), bad, step(candidate_index=2)])])
    events, summary = import_nat_eval_output(path)
    assert [e.candidate_index for e in events] == [0, 2]
    assert summary.skipped == {code: 1} and summary.records == 3
    assert str(summary.problems[0]).startswith(f"{path}:{where[(0, 1)]}: item 0 step 1: {reason}")
    with pytest.raises(DataError) as info:
        import_nat_eval_output(path, strict=True)
    assert f"{path}:{where[(0, 1)]}: item 0 step 1: {reason}" in str(info.value)


def test_strict_lists_all_bad_steps_across_items(tmp_path):
    path, where = nat_file(
        tmp_path,
        [
            ("a", [step(score=None), step()]),
            ("b", [step(), step(output="")]),
        ],
    )
    with pytest.raises(DataError) as info:
        import_nat_eval_output(path, strict=True)
    assert str(info.value).splitlines() == [
        "2 problems in input data:",
        f"{path}:{where[(0, 0)]}: item 0 step 0: 'score' is missing or null",
        f"{path}:{where[(1, 1)]}: item 1 step 1: 'output' is empty",
    ]


def test_unreadable_files(tmp_path):
    bad_json = tmp_path / "a.json"
    bad_json.write_text('[\n {"id": 1,\n  "intermediate_steps": [}\n]')
    with pytest.raises(DataError, match=rf"^{bad_json}:3: malformed JSON"):
        import_nat_eval_output(bad_json)
    bad_utf8 = tmp_path / "b.json"
    bad_utf8.write_bytes(b'[\n{"id": "\xc3\x28"}]')
    with pytest.raises(
        DataError, match=rf"^{bad_utf8}:2: bytes are not valid UTF-8 \(byte 0xc3 at"
    ):
        import_nat_eval_output(bad_utf8)
    layout = tmp_path / "c.json"
    layout.write_text('{"items": []}')
    with pytest.raises(DataError, match="not a NAT evaluation output"):
        import_nat_eval_output(layout)
    with pytest.raises(DataError, match="no such file"):
        import_nat_eval_output(tmp_path / "missing.json")
