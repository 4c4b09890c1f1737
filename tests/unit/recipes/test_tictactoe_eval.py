"""Tic-tac-toe evaluation figures and the TTC events of a decision point."""

import json

import numpy as np
import pytest

from dpojax.data import TTCEvent, read_events, write_events
from dpojax.workflows.tictactoe.evaluation import (
    GameTally,
    candidate_events,
    evaluate,
    move_stats,
    random_move_baseline,
)
from dpojax.workflows.tictactoe.game import (
    batched,
    board_messages,
    board_prompt,
    legal_moves,
    parse_board_prompt,
    perfect_policy,
    random_policy,
    reachable_positions,
    text_policy,
)


def test_random_move_baseline():
    assert round(random_move_baseline(), 2) == 0.58
    assert round(random_move_baseline(nontrivial=True), 2) == 0.40


def test_perfect_policy_evaluation():
    calls = []

    def choose(boards):
        calls.append(len(boards))
        return [perfect_policy(b) for b in boards]

    result = evaluate(choose, batch_size=1000)
    assert calls[:5] == [1000, 1000, 1000, 1000, 520]
    assert result.all_positions.positions == 4520
    assert result.nontrivial_positions.positions == 3191
    summary = result.summary()
    assert summary["optimal_move_rate"] == summary["optimal_move_rate_nontrivial"] == 1.0
    assert summary["illegal_move_rate"] == 0.0
    assert result.vs_random_as_x.games == result.vs_random_as_o.games == 200
    assert summary["games_vs_random"] == 400 and summary["losses_vs_random"] == 0
    assert summary["wins_vs_random"] > 300 and summary["losses_total"] == 0
    for side in ("x", "o"):
        assert summary[f"draws_vs_perfect_as_{side}"] == summary[f"games_vs_perfect_as_{side}"] == 1
    json.dumps(result.to_dict())
    assert result.to_dict()["vs_random"]["games"] == 400


def test_deterministic_policy_plays_its_games_from_the_sweep():
    """A deterministic policy is asked once per position: the games reuse the sweep's answers
    and come out exactly as when it is asked at every move."""
    rng = np.random.default_rng(5)
    fixed = {b: str(rng.integers(1, 10)) for b in reachable_positions()}  # often illegal
    fixed.update({b: perfect_policy(b) for b in list(fixed)[::3]})
    calls = []

    def choose(boards):
        calls.append(len(boards))
        return [fixed[b] for b in boards]

    every_move = evaluate(choose, random_games=60, seed=3)
    asked_at_every_move = len(calls)
    calls.clear()
    once = evaluate(choose, random_games=60, seed=3, batch_size=None, deterministic=True)
    assert calls == [4520] and asked_at_every_move > 5
    assert once == every_move and once.vs_random.games == 60
    assert 0 < once.vs_random.forfeits < 60 and once.vs_random.wins > 0


def test_random_policy_evaluation():
    rng = np.random.default_rng(1)
    result = evaluate(batched(random_policy(rng)), random_games=100, perfect_games=3, seed=2)
    summary = result.summary()
    assert abs(summary["optimal_move_rate"] - 0.58) < 0.03
    assert abs(summary["optimal_move_rate_nontrivial"] - 0.40) < 0.03
    assert summary["illegal_move_rate"] == 0.0 and summary["forfeits_vs_random"] == 0
    assert result.vs_random.games == 100 and result.vs_perfect_as_o.games == 3
    assert summary["wins_vs_perfect_as_x"] == summary["wins_vs_perfect_as_o"] == 0
    assert summary["losses_total"] == (
        summary["losses_vs_random"]
        + summary["losses_vs_perfect_as_x"]
        + summary["losses_vs_perfect_as_o"]
    )
    assert summary["losses_vs_perfect_as_x"] + summary["losses_vs_perfect_as_o"] > 0


def test_evaluation_through_prompt_text_and_illegal_moves():
    """A policy that only sees the prompt text; and one that always answers the centre."""
    via_text = lambda prompt: perfect_policy(parse_board_prompt(prompt))
    for chat in (False, True):
        policy = batched(text_policy(via_text, chat=chat, system="Play."))
        assert evaluate(policy, random_games=20).summary()["optimal_move_rate"] == 1.0

    centre = evaluate(lambda boards: ["5"] * len(boards), random_games=40)
    occupied = sum(b[4] != "." for b in reachable_positions()) / 4520
    assert centre.all_positions.illegal_move_rate == pytest.approx(occupied)
    assert centre.vs_random.forfeits == centre.vs_random.losses == 40  # second move is illegal
    assert centre.vs_random_as_x.games == centre.vs_random_as_o.games == 20
    assert GameTally(1, 1, 0, 0, 0) + GameTally(2, 0, 1, 1, 1) == GameTally(3, 1, 1, 1, 1)


def test_move_stats():
    boards = ["X........", "XX.OO...."]
    stats = move_stats(boards, ["5", "9"])
    assert (stats.positions, stats.optimal_move_rate, stats.illegal_move_rate) == (2, 0.5, 0.0)
    assert stats.mean_move_score == 0.25
    assert move_stats(boards, ["1", "3"]).mean_move_score == 0.0  # -1 and 1
    assert move_stats([], []).optimal_move_rate == 0.0


def test_candidate_events(tmp_path):
    board = "XX.OO...."  # X to move: 3 wins, 6 draws (blocks), 1 is occupied
    outputs = ["3", " 6 ", "1", "", "seven", "9"]
    events = candidate_events(board, outputs, example_id=7, turn_id="g7_t4", turn_index=4)
    assert [e.candidate_index for e in events] == [0, 1, 2, 4, 5]  # the empty output is left out
    assert [e.score for e in events] == [1.0, 0.5, -1.0, -1.0, 0.0]
    assert [e.output for e in events] == ["3", " 6 ", "1", "seven", "9"]
    first = events[0]
    assert (first.example_id, first.turn_id, first.turn_index) == ("7", "g7_t4", 4)
    assert first.input == board_prompt(board) and first.name == "dpo_candidate_move"
    assert first.metadata == {"board": board, "player": "X", "cell": 3, "optimal": True}
    assert [e.metadata["cell"] for e in events] == [3, 6, None, None, 9]
    assert [e.metadata["optimal"] for e in events] == [True, False, False, False, False]

    path = write_events(events, tmp_path / "events.jsonl")
    back, summary = read_events(path, strict=True)
    assert back == events and summary.kept == 5


def test_candidate_events_with_messages_and_extra_metadata():
    board = "X...O...X"
    messages = board_messages(board, system="Play.")
    events = candidate_events(
        board,
        [str(c + 1) for c in legal_moves(board)],
        example_id="e",
        turn_id="t",
        prompt=messages,
        name="step",
        metadata={"game": 3},
    )
    assert all(e.input == messages and e.name == "step" for e in events)
    assert events[0].input is not events[1].input
    assert all(e.metadata["game"] == 3 and e.metadata["player"] == "O" for e in events)
    assert all(isinstance(e, TTCEvent) and e.turn_index is None for e in events)
    assert {e.score for e in events} == {0.0, 0.5}
