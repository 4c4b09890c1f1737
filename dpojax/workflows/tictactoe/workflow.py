"""The built-in tic-tac-toe workflow: self-play (or play against a fixed opponent) with K scored
candidates per decision, exact minimax scores, and the full evaluation of the greedy policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from dpojax.collect.workflow import CandidateGenerator, GreedyPolicy
from dpojax.data.events import TTCEvent
from dpojax.schema import check_values, keys, setting
from dpojax.workflows.tictactoe.evaluation import candidate_events, evaluate
from dpojax.workflows.tictactoe.game import (
    EMPTY_BOARD,
    STYLES,
    apply_move,
    board_prompt,
    is_terminal,
    legal_moves,
    move_text,
    parse_move,
    perfect_policy,
    response_score,
    to_move,
)

OPPONENTS = ("self", "random", "perfect")
CHOICES = ("best", "sampled")


def distinct_moves(outputs: Sequence[str]) -> list[str]:
    """The first response naming each cell, in its canonical form (`move_text`), in the order
    drawn; responses that name no cell are kept as they are (they all score as illegal)."""
    cells, kept = set(), []
    for text in outputs:
        cell = parse_move(text)
        if cell is None:
            kept.append(text)
        elif cell not in cells:
            cells.add(cell)
            kept.append(move_text(cell))
    return kept


def option_problems(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, what is wrong) for each value the option types and choices allow but the game
    does not; the workflow raises on the first, config validation reports each under its key."""
    problems = []
    for name in ("games", "candidates", "min_candidates"):
        if name in options and options[name] < 1:
            problems.append((name, f"must be >= 1, got {options[name]!r}"))
    if options.get("random_opening_plies", 0) < 0:
        problems.append(("random_opening_plies", "must be >= 0"))
    explore = options.get("explore", 0.0)
    if not 0.0 <= explore <= 1.0:
        problems.append(("explore", f"must be a probability in [0, 1], got {explore!r}"))
    return problems


# The evaluation metrics that summaries and reports show first (docs/tictactoe.md).
HEADLINE_METRICS = (
    "optimal_move_rate",
    "optimal_move_rate_nontrivial",
    "illegal_move_rate",
    "losses_vs_random",
    "losses_vs_perfect_as_x",
    "losses_vs_perfect_as_o",
)

# What the game counts among them are, for the loop's tables (`losses_*` are games, not losses).
METRIC_LABELS = {
    "losses_vs_random": "games lost of {games_vs_random} against a random player",
    "losses_vs_perfect_as_x": "games lost of {games_vs_perfect_as_x} against perfect play, as X",
    "losses_vs_perfect_as_o": "games lost of {games_vs_perfect_as_o} against perfect play, as O",
    "losses_total": "games lost against every opponent",
}


@dataclasses.dataclass
class TicTacToeWorkflow:
    """`games` games per collection run, played in lockstep so each ply is one batched call.

    `opponent="self"`: the policy plays both sides; "random" / "perfect": the policy plays X in
    even games and O in odd ones. At each of the policy's decisions it gets `candidates` moves,
    each scored exactly (win 1, draw 0.5, loss 0, illegal -1) and emitted as a TTC event; the game
    continues with the best candidate (`choose="best"`) or the first, i.e. a policy sample
    ("sampled"). The first `random_opening_plies` plies of each game are random legal moves, so
    collection sees varied positions.

    `candidates_up_to_legal=True` keeps, of the K candidates drawn at a decision, only the first
    `min(K, number of legal moves)`. With distinct candidates (drawn in Plackett-Luce order, so the
    first n are themselves a draw of n distinct ones) a position with fewer legal moves than K
    otherwise always yields illegal candidates, however legally the policy plays, and their
    pairs (every legal move against an illegal one, the largest score gaps) crowd out the pairs
    between legal moves that teach good play. It keeps at least `min_candidates` all the same:
    with one legal move a decision otherwise has a single candidate and no pair, so a policy
    that answers such a position with an occupied cell is never corrected; with
    `min_candidates=2` the second candidate is the policy's likeliest other answer.

    `distinct_moves=True` makes the candidates distinct *moves*, not just distinct texts: a
    candidate naming the same cell as an earlier one (` 6` after `6`: the scorer accepts the
    whitespace) is dropped, and the others are emitted in the canonical form (`6`). Without it a
    byte-level tokenizer offers two tokens per move, the policy spreads its probability over
    both, and about a third of the distinct candidates repeat a move already drawn (measured on
    the default recipe), so fewer moves are compared and each move has two tokens to learn.
    Applied before `candidates_up_to_legal`.

    `explore` is the probability that, at one of the policy's decisions, the game goes on with a
    uniformly random legal move instead of the chosen candidate (the decision's candidates are
    emitted either way). Continuing with the best candidate on both sides plays near-perfect
    games, which never reach the positions a blunder leaves, such as an open threat that must be
    blocked; exploration moves visit them, as games against a weak opponent do.
    """

    name: ClassVar[str] = "tictactoe"
    headline_metrics: ClassVar[tuple[str, ...]] = HEADLINE_METRICS
    metric_labels: ClassVar[dict[str, str]] = METRIC_LABELS
    option_problems: ClassVar = staticmethod(option_problems)

    games: int = setting(64, "Games per collection run, played in lockstep.")
    candidates: int = setting(8, "Candidate moves drawn at each of the policy's decisions.")
    opponent: str = setting(
        "self",
        "Who plays the other side: the policy itself, a random player or a perfect one.",
        choices=OPPONENTS,
    )
    choose: str = setting(
        "best",
        "The candidate the game goes on with: the best scored, or the first (a policy sample).",
        choices=CHOICES,
    )
    random_opening_plies: int = setting(
        2, "Up to this many random legal moves open each game (varied positions)."
    )
    style: str = setting("numbers", "How the board is shown in the prompt.", choices=STYLES)
    candidates_up_to_legal: bool = setting(
        False,
        "Keep at most as many candidates as the position has legal moves (the first drawn): "
        "with distinct candidates the rest can only be illegal fillers.",
    )
    distinct_moves: bool = setting(
        False,
        "Candidates are distinct moves: a repeat of an earlier candidate's cell is dropped and "
        "the others are emitted in canonical form (one token per move).",
    )
    explore: float = setting(
        0.0,
        "Probability that a decision's game goes on with a random legal move instead of the "
        "chosen candidate, so self-play also visits the positions that blunders leave.",
    )
    min_candidates: int = setting(
        1,
        "With candidates_up_to_legal: keep at least this many candidates (2: a position with a "
        "single legal move still gets a pair).",
    )

    def __post_init__(self):
        options = dataclasses.asdict(self)
        for problem in check_values(options, list(keys(type(self))), label="option"):
            raise ValueError(problem)
        for name, problem in option_problems(options):
            raise ValueError(f"{name} {problem}")

    def prompt(self, board: str) -> str:
        return board_prompt(board, style=self.style)

    def _opening(self, rng: np.random.Generator) -> str:
        board = EMPTY_BOARD
        for _ in range(int(rng.integers(0, self.random_opening_plies + 1))):
            if is_terminal(board):
                break
            board = apply_move(board, int(rng.choice(legal_moves(board))))
        return board

    def collect(self, generate: CandidateGenerator, *, run_id: str, seed: int) -> list[TTCEvent]:
        rng = np.random.default_rng(seed)
        boards = [self._opening(rng) for _ in range(self.games)]
        policy_side = ["X" if i % 2 == 0 else "O" for i in range(self.games)]
        active = [not is_terminal(b) for b in boards]
        events: list[TTCEvent] = []
        ply = 0
        while any(active):
            mine = [
                i
                for i in range(self.games)
                if active[i] and (self.opponent == "self" or to_move(boards[i]) == policy_side[i])
            ]
            if mine:
                prompts = [self.prompt(boards[i]) for i in mine]
                outputs = generate(prompts, self.candidates)
                for i, prompt, outs in zip(mine, prompts, outputs, strict=True):
                    board = boards[i]
                    if self.distinct_moves:
                        outs = distinct_moves(outs)
                    if self.candidates_up_to_legal:
                        outs = outs[: max(len(legal_moves(board)), self.min_candidates)]
                    events.extend(
                        candidate_events(
                            board,
                            outs,
                            example_id=f"{run_id}_game{i}",
                            turn_id=f"ply{ply}",
                            turn_index=ply,
                            prompt=prompt,
                            style=self.style,
                        )
                    )
                    boards[i], active[i] = self._continue(board, outs, rng)
            for i in range(self.games):
                if active[i] and i not in mine:
                    move = self._opponent_move(boards[i], rng)
                    boards[i] = apply_move(boards[i], move)
                    active[i] = not is_terminal(boards[i])
            ply += 1
        return events

    def _continue(
        self, board: str, outputs: Sequence[str], rng: np.random.Generator
    ) -> tuple[str, bool]:
        if not outputs:
            return board, False
        if self.explore and rng.random() < self.explore:
            board = apply_move(board, int(rng.choice(legal_moves(board))))
            return board, not is_terminal(board)
        if self.choose == "best":
            scores = [response_score(board, text) for text in outputs]
            text = outputs[int(np.argmax(scores))]
        else:
            text = outputs[0]
        cell = parse_move(text)
        if cell is None or cell not in legal_moves(board):
            return board, False  # an illegal continuation ends the game (a forfeit)
        board = apply_move(board, cell)
        return board, not is_terminal(board)

    def _opponent_move(self, board: str, rng: np.random.Generator) -> int:
        if self.opponent == "perfect":
            return parse_move(perfect_policy(board))
        return int(rng.choice(legal_moves(board)))

    def evaluate(self, greedy: GreedyPolicy) -> dict[str, float]:
        """The greedy policy's quality: optimal-move rates, illegal moves, games (see
        `dpojax.workflows.tictactoe.evaluation.evaluate`). Greedy answers are deterministic:
        the policy answers the 4,520 positions in one call (it splits them into batches
        itself), and the games reuse those answers."""
        result = evaluate(
            lambda boards: greedy([self.prompt(b) for b in boards]),
            seed=0,
            batch_size=None,
            deterministic=True,
        )
        return dict(result.summary())
