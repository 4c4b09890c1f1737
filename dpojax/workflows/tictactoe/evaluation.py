"""Evaluation of a tic-tac-toe policy, and the TTC events of one decision point.

`evaluate(choose)` measures a batched policy (`boards -> move texts`, see `tictactoe.BatchPolicy`;
wrap a one-board policy with `tictactoe.batched`):
- the optimal-move rate over all 4,520 reachable non-terminal positions and over the 3,191 where
  not every legal move is optimal (a uniformly random legal move scores about 0.58 and 0.40), and
  the illegal-move rate over all 4,520;
- `random_games` games against a seeded random player, half as X and half as O;
- games against the deterministic perfect player as X and as O.

`candidate_events(board, outputs, ...)` scores K candidate responses with the exact scorer and
returns the `TTCEvent` records a workflow emits for that decision point.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, fields
from statistics import fmean
from typing import Any

import numpy as np

from dpojax.data.events import DEFAULT_TTC_STEP_NAME, TTCEvent
from dpojax.data.records import Prompt
from dpojax.workflows.tictactoe.game import (
    BatchPolicy,
    Board,
    GameRecord,
    Player,
    Style,
    batched,
    board_prompt,
    is_nontrivial,
    legal_moves,
    optimal_moves,
    parse_move,
    perfect_policy,
    play_games,
    random_policy,
    reachable_positions,
    response_score,
    to_move,
)


@dataclass(frozen=True, slots=True)
class GameTally:
    """Results of some games from the evaluated policy's side; `forfeits` counts its losses by an
    illegal move (included in `losses`)."""

    games: int = 0
    wins: int = 0
    draws: int = 0
    losses: int = 0
    forfeits: int = 0

    def __add__(self, other: GameTally) -> GameTally:
        return GameTally(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def tally_games(games: Sequence[GameRecord], side: Player) -> GameTally:
    """Counts of `games` from `side`'s point of view."""
    results = [g.result_for(side) for g in games]
    return GameTally(
        games=len(games),
        wins=results.count("win"),
        draws=results.count("draw"),
        losses=results.count("loss"),
        forfeits=sum(g.forfeit == side for g in games),
    )


@dataclass(frozen=True, slots=True)
class MoveStats:
    """Move quality over a set of positions."""

    positions: int
    optimal_move_rate: float
    illegal_move_rate: float
    mean_move_score: float
    """Mean exact score of the chosen moves, illegal ones counted as -1."""


@dataclass(frozen=True, slots=True)
class TicTacToeEval:
    """Everything `evaluate` measures; `summary()` gives the flat figures for reports."""

    all_positions: MoveStats
    nontrivial_positions: MoveStats
    vs_random_as_x: GameTally
    vs_random_as_o: GameTally
    vs_perfect_as_x: GameTally
    vs_perfect_as_o: GameTally

    @property
    def vs_random(self) -> GameTally:
        """Both sides' games against the random player."""
        return self.vs_random_as_x + self.vs_random_as_o

    def summary(self) -> dict[str, float | int]:
        """Flat figures: the rates, wins/draws/losses (and forfeits) per opponent, and
        `losses_total`, the games lost against all opponents."""
        out: dict[str, float | int] = {
            "optimal_move_rate": self.all_positions.optimal_move_rate,
            "optimal_move_rate_nontrivial": self.nontrivial_positions.optimal_move_rate,
            "illegal_move_rate": self.all_positions.illegal_move_rate,
            "mean_move_score": self.all_positions.mean_move_score,
        }
        for name in ("vs_random", "vs_perfect_as_x", "vs_perfect_as_o"):
            tally: GameTally = getattr(self, name)
            for key in ("games", "wins", "draws", "losses", "forfeits"):
                out[f"{key}_{name}"] = getattr(tally, key)
        out["losses_total"] = sum(
            out[f"losses_{name}"] for name in ("vs_random", "vs_perfect_as_x", "vs_perfect_as_o")
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The nested form (JSON-serialisable), with the flat `summary` under `"summary"`."""
        out = {f.name: asdict(getattr(self, f.name)) for f in fields(self)}
        out["vs_random"] = asdict(self.vs_random)
        out["summary"] = self.summary()
        return out


def _choose_all(choose: BatchPolicy, boards: Sequence[Board], batch_size: int | None) -> list[str]:
    size = max(batch_size or len(boards), 1)
    texts: list[str] = []
    for start in range(0, len(boards), size):
        chunk = boards[start : start + size]
        out = list(choose(chunk))
        if len(out) != len(chunk):
            raise ValueError(f"policy returned {len(out)} moves for {len(chunk)} boards")
        texts.extend(out)
    return texts


def move_stats(boards: Sequence[Board], texts: Sequence[str]) -> MoveStats:
    """Move quality of the responses `texts` on `boards` (one each)."""
    scores = [response_score(b, t) for b, t in zip(boards, texts, strict=True)]
    optimal = [parse_move(t) in optimal_moves(b) for b, t in zip(boards, texts, strict=True)]
    n = len(boards)
    return MoveStats(
        positions=n,
        optimal_move_rate=sum(optimal) / n if n else 0.0,
        illegal_move_rate=sum(s < 0 for s in scores) / n if n else 0.0,
        mean_move_score=fmean(scores) if n else 0.0,
    )


def random_move_baseline(*, nontrivial: bool = False) -> float:
    """Expected optimal-move rate of a uniformly random legal move (about 0.58; 0.40 nontrivial)."""
    boards = [b for b in reachable_positions() if not nontrivial or is_nontrivial(b)]
    return fmean(len(optimal_moves(b)) / len(legal_moves(b)) for b in boards)


def answer_table(choose: BatchPolicy, answers: Mapping[Board, str]) -> BatchPolicy:
    """A batched policy that gives the answers in `answers` and asks `choose` (in one call) for
    the boards it lacks."""

    def policy(boards: Sequence[Board]) -> list[str]:
        missing = [b for b in dict.fromkeys(boards) if b not in answers]
        asked = dict(zip(missing, choose(missing), strict=True)) if missing else {}
        return [answers[b] if b in answers else asked[b] for b in boards]

    return policy


def evaluate(
    choose: BatchPolicy,
    *,
    random_games: int = 400,
    perfect_games: int = 1,
    seed: int = 0,
    batch_size: int | None = 1024,
    deterministic: bool = False,
) -> TicTacToeEval:
    """Evaluates a batched policy (see the module docstring).

    `random_games` are split half as X, half as O (X gets the odd one); the random player draws
    from `np.random.default_rng(seed)`. `perfect_games` games are played on each side against the
    perfect player (one suffices for a deterministic policy). `batch_size` caps how many boards
    go into one call of `choose` for the position sweep (None: all at once).

    `deterministic=True` (a policy that always gives a board the same answer, e.g. greedy
    decoding): the games take each move from the sweep's answer to that board, which covers
    every position a game can reach, so the games cost no further call of `choose`; the games
    and their results are those of asking the policy at every move.
    """
    boards = reachable_positions()
    texts = _choose_all(choose, boards, batch_size)
    nontrivial = [i for i, b in enumerate(boards) if is_nontrivial(b)]
    rng = np.random.default_rng(seed)
    rand = batched(random_policy(rng))
    perfect = batched(perfect_policy)
    if deterministic:
        choose = answer_table(choose, dict(zip(boards, texts, strict=True)))
    as_x = random_games - random_games // 2
    return TicTacToeEval(
        all_positions=move_stats(boards, texts),
        nontrivial_positions=move_stats(
            [boards[i] for i in nontrivial], [texts[i] for i in nontrivial]
        ),
        vs_random_as_x=tally_games(play_games(choose, rand, as_x), "X"),
        vs_random_as_o=tally_games(play_games(rand, choose, random_games // 2), "O"),
        vs_perfect_as_x=tally_games(play_games(choose, perfect, perfect_games), "X"),
        vs_perfect_as_o=tally_games(play_games(perfect, choose, perfect_games), "O"),
    )


def candidate_events(
    board: Board,
    outputs: Sequence[str],
    *,
    example_id: str | int,
    turn_id: str | int,
    turn_index: int | None = None,
    prompt: Prompt | None = None,
    style: Style = "numbers",
    name: str = DEFAULT_TTC_STEP_NAME,
    metadata: Mapping[str, Any] | None = None,
) -> list[TTCEvent]:
    """The TTC events of one decision point: candidate `k` of `outputs` (the responses of the side
    to move on `board`) becomes an event with `candidate_index=k`, `input=prompt` (default:
    `board_prompt(board, style=style)`), `output` the response and `score` its exact score
    (win 1, draw 0.5, loss 0, illegal -1).

    `metadata` holds `board`, `player`, `cell` (1-based, or None when illegal) and `optimal`,
    plus the caller's `metadata`. Responses that are empty or whitespace-only are left out (the
    event format requires a non-empty output), so candidate indices may then have gaps.
    """
    prompt = board_prompt(board, style=style) if prompt is None else prompt
    player = to_move(board)
    best = optimal_moves(board)
    events = []
    for k, text in enumerate(outputs):
        if not text.strip():
            continue
        score = response_score(board, text)
        cell = parse_move(text) if score >= 0 else None
        meta = {
            "board": board,
            "player": player,
            "cell": None if cell is None else cell + 1,
            "optimal": cell in best,
            **(metadata or {}),
        }
        events.append(
            TTCEvent(
                example_id=str(example_id),
                turn_id=str(turn_id),
                turn_index=turn_index,
                candidate_index=k,
                input=prompt if isinstance(prompt, str) else [dict(m) for m in prompt],
                output=text,
                score=score,
                name=name,
                metadata=meta,
            )
        )
    return events
