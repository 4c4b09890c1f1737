"""Pair building equals NAT 1.9's DPO trajectory builder (docs/data.md#building-pairs), dedup and seeded sampling."""

import json

import pytest

from dpojax.data import (
    PreferencePair,
    TTCEvent,
    build_pairs,
    dedup_pairs,
    import_nat_eval_output,
    read_events,
    sample_pairs,
    write_events,
)


def ev(
    score,
    out,
    *,
    turn="t1",
    example="e1",
    idx=None,
    prompt="p",
    name="dpo_candidate_move",
    metadata=None,
):
    return TTCEvent(
        example_id=example,
        turn_id=turn,
        candidate_index=idx or 0,
        input=prompt,
        output=out,
        score=score,
        name=name,
        metadata=metadata,
    )


def summary(result):
    """(chosen, rejected, score_diff) per pair."""
    return [(p.chosen, p.rejected, p.metadata["score_diff"]) for p in result.pairs]


def test_ties_keep_trajectory_order_and_pairs_sort_by_diff():
    # Reference example: A=1.0, B=1.0, C=0.5 -> generated (A,B,0), (A,C,.5), (B,C,.5); sorted by d.
    result = build_pairs([ev(1.0, "A", idx=0), ev(1.0, "B", idx=1), ev(0.5, "C", idx=2)])
    assert summary(result) == [("A", "C", 0.5), ("B", "C", 0.5), ("A", "B", 0.0)]
    assert [(p.metadata["chosen_index"], p.metadata["rejected_index"]) for p in result.pairs] == [
        (0, 2),
        (1, 2),
        (0, 1),
    ]
    assert result.stats.skipped_score_diff == 0


def test_sort_is_stable_for_ties_in_the_middle():
    events = [ev(0.0, "low"), ev(0.5, "x"), ev(1.0, "top"), ev(0.5, "y")]
    # ranked: top, x, y, low; equal d keep generation order (i, then j).
    assert summary(build_pairs(events)) == [
        ("top", "low", 1.0),
        ("top", "x", 0.5),
        ("top", "y", 0.5),
        ("x", "low", 0.5),
        ("y", "low", 0.5),
        ("x", "y", 0.0),
    ]


def test_threshold_is_inclusive():
    events = [ev(1.0, "a"), ev(0.75, "b"), ev(0.5, "c")]  # d = 0.25, 0.5, 0.25 exactly
    result = build_pairs(events, min_score_diff=0.25)
    assert summary(result) == [("a", "c", 0.5), ("a", "b", 0.25), ("b", "c", 0.25)]
    result = build_pairs(events, min_score_diff=0.2500001)
    assert summary(result) == [("a", "c", 0.5)] and result.stats.skipped_score_diff == 2
    # Plain float subtraction, as NAT: 0.73 - 0.5 = 0.22999999999999998 < 0.23.
    result = build_pairs([ev(0.73, "a"), ev(0.5, "b")], min_score_diff=0.23)
    assert result.pairs == [] and result.stats.skipped_score_diff == 1


def test_ties_dropped_by_positive_threshold():
    result = build_pairs([ev(0.5, "a"), ev(0.5, "b")], min_score_diff=0.01)
    assert result.pairs == [] and result.stats.skipped_score_diff == 1
    result = build_pairs([ev(0.5, "a"), ev(0.5, "b")])
    assert summary(result) == [("a", "b", 0.0)]


def test_per_turn_cap_in_exhaustive_mode_only():
    events = [
        ev(4.0, "a"),
        ev(3.0, "b"),
        ev(2.5, "c"),
        ev(0.0, "d"),
        ev(1.0, "x", turn="t2"),
        ev(0.0, "y", turn="t2"),
        ev(0.0, "z", turn="t2"),
    ]
    full = build_pairs(events)
    assert len(full.pairs) == 6 + 3
    capped = build_pairs(events, max_pairs_per_turn=2)
    assert summary(capped) == [("a", "d", 4.0), ("b", "d", 3.0), ("x", "y", 1.0), ("x", "z", 1.0)]
    assert capped.stats.skipped_score_diff == 0  # truncation is not counted
    assert capped.stats.total_pairs == 4
    filtered = build_pairs(events, max_pairs_per_turn=2, min_score_diff=1.0)
    assert filtered.stats.skipped_score_diff == 2  # (b,c) in t1, (y,z) in t2; d == 1 kept
    bvw = build_pairs(events, exhaustive_pairs=False, max_pairs_per_turn=1)
    assert summary(bvw) == summary(build_pairs(events, exhaustive_pairs=False))


def test_best_vs_worst_ties_and_metadata():
    events = [
        ev(1.0, "top1", idx=0),
        ev(0.0, "low1", idx=1),
        ev(1.0, "top2", idx=2),
        ev(0.0, "low2", idx=3),
    ]
    (pair,) = build_pairs(events, exhaustive_pairs=False).pairs
    assert (pair.chosen, pair.rejected) == ("top1", "low2")  # earliest top, latest bottom
    assert pair.metadata["num_candidates"] == 4
    assert "chosen_raw_metadata" not in pair.metadata
    result = build_pairs(events[:1] + events[2:3], exhaustive_pairs=False, min_score_diff=0.0)
    assert summary(result) == [("top1", "top2", 0.0)]
    result = build_pairs(events[:1] + events[2:3], exhaustive_pairs=False, min_score_diff=0.1)
    assert result.pairs == [] and result.stats.skipped_score_diff == 1


@pytest.mark.parametrize("exhaustive", [True, False])
def test_single_candidates(exhaustive):
    events = [ev(1.0, "a", turn="solo"), ev(1.0, "b", turn="t2"), ev(0.0, "c", turn="t2")]
    strict = build_pairs(events, exhaustive_pairs=exhaustive)
    assert summary(strict) == [("b", "c", 1.0)]
    assert strict.stats.skipped_single_candidate == 1 and strict.stats.total_turns == 2
    loose = build_pairs(events, exhaustive_pairs=exhaustive, require_multiple_candidates=False)
    assert summary(loose) == summary(strict) and loose.stats.skipped_single_candidate == 0


def test_chosen_prompt_messages_and_raw_metadata():
    p_b = [{"role": "system", "content": "s"}, {"role": "user", "content": "board B"}]
    events = [
        ev(0.0, "lo", prompt=[dict(m) for m in p_b], metadata={"m": "lo"}),
        ev(1.0, "hi", prompt=p_b, metadata={"m": "hi"}),
    ]
    (pair,) = build_pairs(events).pairs
    assert pair.prompt == p_b and pair.prompt is not p_b  # the chosen candidate's prompt, copied
    assert pair.metadata["chosen_raw_metadata"] == {"m": "hi"}
    assert pair.metadata["rejected_raw_metadata"] == {"m": "lo"}
    pair.prompt[0]["content"] = "changed"
    assert p_b[0]["content"] == "s"
    (pair,) = build_pairs([ev(1.0, "a"), ev(0.0, "b")]).pairs
    assert pair.metadata["chosen_raw_metadata"] == {}


def test_reward_modes_and_metadata():
    events = [
        ev(3.0, "a", idx=4, example="ex", turn="tt"),
        ev(1.0, "b", idx=7, example="ex", turn="tt"),
    ]
    (pair,) = build_pairs(events).pairs
    assert pair.reward == 2.0 == pair.metadata["reward"]
    assert {k: v for k, v in pair.metadata.items() if "raw" not in k} == {
        "dpo_type": "preference_pair",
        "reward": 2.0,
        "score_diff": 2.0,
        "example_id": "ex",
        "turn_id": "tt",
        "chosen_score": 3.0,
        "rejected_score": 1.0,
        "chosen_index": 4,
        "rejected_index": 7,
    }
    (pair,) = build_pairs(events, reward_from_score_diff=False).pairs
    assert pair.reward == 3.0 and pair.metadata["score_diff"] == 2.0


def test_step_name_filter_is_exact():
    events = [
        ev(1.0, "a"),
        ev(0.0, "b"),
        ev(0.5, "c", name="DPO_candidate_move"),
        ev(0.2, "d", name="other"),
    ]
    result = build_pairs(events)
    assert summary(result) == [("a", "b", 1.0)] and result.stats.total_candidates == 2
    other = build_pairs(events, ttc_step_name="other")
    assert other.pairs == [] and other.stats.skipped_single_candidate == 1


def test_grouping_order_and_counters():
    events = [
        ev(1.0, "a1", example="A", turn="1"),
        ev(1.0, "b1", example="B", turn="1"),
        ev(1.0, "a2", example="A", turn="2"),
        ev(0.0, "a1x", example="A", turn="1"),
        ev(0.0, "b1x", example="B", turn="1"),
        ev(0.0, "a2x", example="A", turn="2"),
        ev(0.0, "c", example="C", turn="1"),
    ]
    result = build_pairs(events)
    assert [p.chosen for p in result.pairs] == ["a1", "a2", "b1"]
    assert [[p.chosen for p in g] for g in result.groups] == [["a1", "a2"], ["b1"]]
    assert result.stats.as_dict() == {
        "total_examples": 2,
        "total_turns": 4,
        "total_candidates": 7,
        "total_pairs": 3,
        "total_trajectories": 3,
        "skipped_single_candidate": 1,
        "skipped_score_diff": 0,
        "mixed_input_turns": 0,
    }


@pytest.mark.parametrize("exhaustive", [True, False])
def test_pairs_never_join_candidates_that_answered_different_inputs(exhaustive, caplog):
    board_a = [{"role": "user", "content": "board A"}]
    board_b = [{"role": "user", "content": "board B"}]
    events = [  # one turn id, two inputs (a producer reusing a turn id)
        ev(1.0, "a-best", prompt=board_a),
        ev(0.9, "b-best", prompt=board_b),
        ev(0.5, "a-worst", prompt=[dict(m) for m in board_a]),
        ev(0.1, "b-worst", prompt=board_b),
        ev(0.0, "c-only", prompt="board C"),
        ev(1.0, "x", turn="t2"),
        ev(0.0, "y", turn="t2"),
    ]
    with caplog.at_level("WARNING", logger="dpojax.data"):
        result = build_pairs(events, exhaustive_pairs=exhaustive)
    answers = {"board A": {"a-best", "a-worst"}, "board B": {"b-best", "b-worst"}, "p": {"x", "y"}}
    assert len(result.pairs) == 3
    for pair in result.pairs:
        prompt = pair.prompt if isinstance(pair.prompt, str) else pair.prompt[-1]["content"]
        assert {pair.chosen, pair.rejected} == answers[prompt]
    assert result.stats.mixed_input_turns == 1
    assert result.stats.mixed_input_ids == ["e1::t1"]
    assert "1 turns whose candidates answered different inputs" in caplog.text
    assert "'e1::t1'" in caplog.text and "'e1::t1'" in str(result.stats)


def test_joined_turn_keys_with_different_inputs_are_not_paired():
    # ids containing `::` merge two turns (as in NAT); their different inputs keep them apart
    events = [
        ev(1.0, "a", example="x::y", turn="z", prompt="first"),
        ev(0.0, "b", example="x", turn="y::z", prompt="second"),
    ]
    result = build_pairs(events)
    assert result.pairs == [] and result.stats.mixed_input_ids == ["x::y::z"]


def test_turn_key_is_nats_joined_string():
    # NAT keys turns by f"{example_id}::{turn_id}", so these two candidates share a turn.
    result = build_pairs(
        [ev(1.0, "a", example="x::y", turn="z"), ev(0.0, "b", example="x", turn="y::z")]
    )
    assert result.stats.total_turns == 1 and len(result.pairs) == 1


def test_invalid_options():
    with pytest.raises(ValueError, match="min_score_diff"):
        build_pairs([], min_score_diff=-0.1)
    with pytest.raises(ValueError, match="max_pairs_per_turn"):
        build_pairs([], max_pairs_per_turn=0)
    empty = build_pairs([])
    assert empty.pairs == [] and empty.groups == [] and empty.stats.total_examples == 0


def _assert_matches_nat(pairs, stats, case):
    expected = case["pairs"]
    assert len(pairs) == len(expected)
    for got, want in zip(pairs, expected, strict=True):
        assert (got.prompt, got.chosen, got.rejected) == (
            want["prompt"],
            want["chosen"],
            want["rejected"],
        )
        assert got.reward == want["reward"]
        extra = {"reward", "chosen_raw_metadata", "rejected_raw_metadata"}
        assert set(got.metadata) - extra == set(want["metadata"])
        for key, value in want["metadata"].items():
            assert got.metadata[key] == value and type(got.metadata[key]) is type(value), key
    counters = stats.as_dict()
    assert counters["total_pairs"] == counters["total_trajectories"] == len(expected)
    for key, value in counters.items():
        assert value == case["counters"].get(key, value if key.startswith("total") else 0), key


@pytest.mark.parametrize("via_jsonl", [False, True])
def test_real_nat_sample_reproduced_exactly(nat_sample, tmp_path, via_jsonl):
    sample, expected_path = nat_sample
    events, _ = import_nat_eval_output(sample)
    if via_jsonl:
        events, _ = read_events(write_events(events, tmp_path / "events.jsonl"), strict=True)
    expected = json.loads(expected_path.read_text())
    assert set(expected) == {"default", "best_vs_worst_min0.5"}
    for case in expected.values():
        result = build_pairs(events, **case["options"])
        _assert_matches_nat(result.pairs, result.stats, case)
    default = build_pairs(events).stats
    assert (default.total_examples, default.total_turns, default.total_candidates) == (3, 6, 18)


def pair(prompt, chosen="c", rejected="r", **metadata):
    return PreferencePair(prompt, chosen, rejected, metadata)


def test_dedup_key_and_first_occurrence_wins():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    pairs = [
        pair("p", n=0),
        pair("p", n=1),  # duplicate of 0
        pair("p ", n=2),  # no normalisation
        pair("P", n=3),
        pair("p", "c", "r2", n=4),
        pair(msgs, n=5),
        pair([dict(m) for m in msgs], n=6),  # equal messages -> duplicate of 5
        pair([{"role": "user", "content": "s"}, msgs[1]], n=7),  # a role differs
        pair([{"role": "system", "content": "S"}, msgs[1]], n=8),  # an earlier content differs
        pair(msgs[1:], n=9),  # same last message, fewer messages
        pair("u", n=10),  # string equal to the last message's content
        pair("p", n=11),
    ]
    assert [p.metadata["n"] for p in dedup_pairs(pairs)] == [0, 2, 3, 4, 5, 7, 8, 9, 10]


def test_dedup_keeps_pairs_whose_template_arguments_differ():
    tool = {"type": "function", "function": {"name": "move", "parameters": {}}}
    msgs = [{"role": "user", "content": "u"}]
    pairs = [
        PreferencePair(msgs, "c", "r", {"n": 0}),
        PreferencePair(msgs, "c", "r", {"n": 1}, tools=[tool]),
        PreferencePair(msgs, "c", "r", {"n": 2}, tools=[dict(tool)]),  # same tools as 1
        PreferencePair(msgs, "c", "r", {"n": 3}, chat_kwargs={"enable_thinking": False}),
        PreferencePair(msgs, "c", "r", {"n": 4}, chat_kwargs={"enable_thinking": True}),
        PreferencePair(msgs, "c", "r", {"n": 5}, tools=[], chat_kwargs={}),
        PreferencePair(msgs, "c", "r", {"n": 6}, chat_kwargs={"enable_thinking": True}),
    ]
    assert [p.metadata["n"] for p in dedup_pairs(pairs)] == [0, 1, 3, 4, 5]


def test_dedup_on_built_pairs():
    events = [
        ev(1.0, "a", turn="1"),
        ev(0.0, "b", turn="1"),
        ev(1.0, "a", turn="2"),
        ev(0.0, "b", turn="2"),
    ]
    result = build_pairs(events)
    kept = dedup_pairs(result.pairs)
    assert len(result.pairs) == 2 and [p.metadata["turn_id"] for p in kept] == ["1"]


def test_sample_pairs_is_seeded_and_reproducible():
    items = list(range(10))
    assert sample_pairs(items, 3, seed=0) == [3, 2, 1]  # pinned: same on every platform/version
    assert sample_pairs(items, 3, seed=1) == [9, 2, 4]
    big = list(range(1000))
    one = sample_pairs(big, 100, seed=7)
    assert one == sample_pairs(big, 100, seed=7)
    assert one != sample_pairs(big, 100, seed=8)
    assert len(set(one)) == 100 and set(one) <= set(big)
    assert sample_pairs(big, 100, seed=7)[:10] != sorted(one)[:10]  # sample order, not input order
    assert sample_pairs(items, 10, seed=3) == items  # no more than max_pairs: unchanged
    assert sample_pairs(items, 50, seed=3) == items
    with pytest.raises(ValueError):
        sample_pairs(items, 0, seed=0)
