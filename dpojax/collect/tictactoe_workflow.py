"""The built-in tic-tac-toe workflow: self-play (or play against a fixed opponent) with K scored
candidates per decision, exact minimax scores, and the full evaluation of the greedy policy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpojax.collect.tictactoe import (
    EMPTY_BOARD,
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
from dpojax.collect.tictactoe_eval import candidate_events, evaluate
from dpojax.collect.workflow import CandidateGenerator, GreedyPolicy
from dpojax.data.events import TTCEvent

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


def option_problems(*, explore: float, min_candidates: int) -> list[tuple[str, str]]:
    """(option, what is wrong) for each bad value; the workflow raises on the first, config
    validation reports each under its key."""
    problems = []
    if min_candidates < 1:
        problems.append(("min_candidates", f"must be >= 1, got {min_candidates!r}"))
    if not 0.0 <= explore <= 1.0:
        problems.append(("explore", f"must be a probability in [0, 1], got {explore!r}"))
    return problems


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

    name = "tictactoe"

    def __init__(
        self,
        games: int = 64,
        candidates: int = 8,
        opponent: str = "self",
        choose: str = "best",
        random_opening_plies: int = 2,
        style: str = "numbers",
        candidates_up_to_legal: bool = False,
        distinct_moves: bool = False,
        explore: float = 0.0,
        min_candidates: int = 1,
    ):
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent must be one of {OPPONENTS}, got {opponent!r}")
        if choose not in CHOICES:
            raise ValueError(f"choose must be one of {CHOICES}, got {choose!r}")
        if games < 1 or candidates < 1 or random_opening_plies < 0:
            raise ValueError("games and candidates must be >= 1, random_opening_plies >= 0")
        for name, problem in option_problems(explore=explore, min_candidates=min_candidates):
            raise ValueError(f"{name} {problem}")
        self.games, self.candidates = games, candidates
        self.opponent, self.choose = opponent, choose
        self.random_opening_plies, self.style = random_opening_plies, style
        self.candidates_up_to_legal = candidates_up_to_legal
        self.distinct_moves = distinct_moves
        self.explore = explore
        self.min_candidates = min_candidates

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
        `dpojax.collect.tictactoe_eval.evaluate`)."""
        result = evaluate(lambda boards: greedy([self.prompt(b) for b in boards]), seed=0)
        return dict(result.summary())
