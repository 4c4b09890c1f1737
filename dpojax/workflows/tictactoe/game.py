"""Tic-tac-toe for the built-in workflow: rules, exact minimax scorer, LLM text format, players.

A board is a 9-character string over `X`, `O` and `.` (empty), cells in row-major order, so cell
index 0..8 is shown to the model as cell number 1..9:

    1 2 3
    4 5 6
    7 8 9

X moves first; the side to move is X when both have the same number of marks, otherwise O.

**Scorer.** `move_score(board, move)` is the value of `move` for the mover under perfect play by
both sides afterwards: win 1.0, draw 0.5, loss 0.0, and -1.0 for an illegal move (unparsable
text, an occupied or out-of-range cell, or a finished game). It is exact for every position: the
memo of `position_value` is keyed by (board, side to move) and stores the exact value *for the
side to move*, so the perspective is part of the key. (NeMo Agent Toolkit's example keys its cache
without the perspective and stores alpha-beta bounds as exact values, which mislabels many
positions.)

**Text format.** `board_prompt(board)`:

    Board:
    X 2 3
    4 O 6
    7 8 9
    You are X. Your move:

Empty cells show their number (or `.` with `style="dots"`), cells are separated by one space so the
tiny tokenizer (`dpojax.models.tiny.build_tokenizer`) gives one token per cell (23 to 27 tokens
per prompt with BOS). `style="grid"` separates cells with `|` (`X|2|3`), and `style="letters"`
(the default recipe's) also names each mark by its cell and owner relative to the mover: the
mover's mark in cell k is the k-th lowercase letter, the opponent's the k-th uppercase one
(`a|2|C` means: mine in cell 1, theirs in cell 3). The response is a single cell number, e.g.
`5` (plus EOS, which the sampler strips); `parse_move` accepts exactly one digit 1-9, optionally
surrounded by whitespace.

**Players.** A `Policy` maps a board to move text; a `BatchPolicy` maps a list of boards to a list
of move texts (one model call for many games). `random_policy(rng)`, `perfect_policy` and any
callable (self-play: the same policy on both sides) plug into `play_game` / `play_games`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Board = str
"""9 characters over `X`, `O`, `.` in row-major order."""
Player = Literal["X", "O"]
Style = Literal["numbers", "dots", "grid", "letters", "compact"]
STYLES = ("numbers", "dots", "grid", "letters", "compact")
_MINE, _THEIRS = "abcdefghi", "ABCDEFGHI"
Message = dict[str, str]

EMPTY_BOARD: Board = "." * 9
ILLEGAL_SCORE = -1.0
WIN, DRAW, LOSS = 1.0, 0.5, 0.0
WIN_LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2),
    (3, 4, 5),
    (6, 7, 8),
    (0, 3, 6),
    (1, 4, 7),
    (2, 5, 8),
    (0, 4, 8),
    (2, 4, 6),
)
_VALID_BOARD = re.compile(r"[XO.]{9}")
_MOVE = re.compile(r"\s*([1-9])\s*")

Policy = Callable[[Board], str]
"""A player: board -> move text (the side to move is `to_move(board)`)."""
BatchPolicy = Callable[[Sequence[Board]], list[str]]
"""A batched player: boards -> one move text per board, in order."""


# ---------------------------------------------------------------------------------------------
# Rules


def check_board(board: Board) -> Board:
    """Returns `board` if it is 9 characters over `X`, `O`, `.`; raises `ValueError` otherwise."""
    if not isinstance(board, str) or not _VALID_BOARD.fullmatch(board):
        raise ValueError(f"a board is 9 characters over 'X', 'O', '.', got {board!r}")
    return board


def other(player: Player) -> Player:
    """The opponent of `player`."""
    return "O" if player == "X" else "X"


def to_move(board: Board) -> Player:
    """The side to move: X when both sides have the same number of marks, otherwise O."""
    return "X" if board.count("X") == board.count("O") else "O"


def winner(board: Board) -> Player | None:
    """The side with three in a row, or None."""
    for a, b, c in WIN_LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]  # type: ignore[return-value]
    return None


def is_terminal(board: Board) -> bool:
    """True when someone has won or the board is full."""
    return winner(board) is not None or "." not in board


def legal_moves(board: Board) -> tuple[int, ...]:
    """Empty cells (0-based, ascending); none once the game is over."""
    if winner(board) is not None:
        return ()
    return tuple(i for i, c in enumerate(board) if c == ".")


def apply_move(board: Board, cell: int, player: Player | None = None) -> Board:
    """The board after `player` (default: the side to move) marks `cell`; ValueError if illegal."""
    if cell not in legal_moves(board):
        raise ValueError(f"illegal move: cell {cell} on board {board!r}")
    player = to_move(board) if player is None else player
    return board[:cell] + player + board[cell + 1 :]


@functools.cache
def _all_positions() -> tuple[Board, ...]:
    seen = {EMPTY_BOARD}
    frontier = [EMPTY_BOARD]
    while frontier:
        nxt = []
        for board in frontier:
            for cell in legal_moves(board):
                child = apply_move(board, cell)
                if child not in seen:
                    seen.add(child)
                    nxt.append(child)
        frontier = nxt
    return tuple(sorted(seen, key=lambda b: (9 - b.count("."), b)))


def reachable_positions(*, include_terminal: bool = False) -> tuple[Board, ...]:
    """Every position reachable from the empty board by legal play (X first), in a fixed order
    (by number of marks, then by string): 4,520 non-terminal ones, 5,478 with terminal ones."""
    boards = _all_positions()
    return boards if include_terminal else tuple(b for b in boards if not is_terminal(b))


# ---------------------------------------------------------------------------------------------
# Exact minimax scorer


@functools.cache
def _value(board: Board, player: Player) -> float:
    # Exact value for `player`, who is to move on `board`; the key includes the perspective.
    won = winner(board)
    if won is not None:
        return WIN if won == player else LOSS
    if "." not in board:
        return DRAW
    opponent = other(player)
    best = LOSS
    for cell in legal_moves(board):
        child = board[:cell] + player + board[cell + 1 :]
        best = max(best, WIN - _value(child, opponent))
        if best == WIN:
            break
    return best


def position_value(board: Board, player: Player | None = None) -> float:
    """Value of `board` for `player` to move (default: `to_move(board)`) under perfect play by
    both sides: 1.0 win, 0.5 draw, 0.0 loss. Terminal boards give their result for `player`."""
    check_board(board)
    return _value(board, to_move(board) if player is None else player)


def move_score(board: Board, move: int | None, player: Player | None = None) -> float:
    """Score of `move` (0-based cell, or None for an unparsable answer) for the mover `player`
    (default: `to_move(board)`): the exact value after the move under perfect play (win 1.0,
    draw 0.5, loss 0.0), or -1.0 when the move is illegal."""
    check_board(board)
    if move is None or move not in legal_moves(board):
        return ILLEGAL_SCORE
    player = to_move(board) if player is None else player
    return WIN - _value(board[:move] + player + board[move + 1 :], other(player))


def move_scores(board: Board, player: Player | None = None) -> tuple[float, ...]:
    """`move_score` of each of the 9 cells (-1.0 for occupied cells)."""
    return tuple(move_score(board, cell, player) for cell in range(9))


def optimal_moves(board: Board, player: Player | None = None) -> tuple[int, ...]:
    """The legal cells with the best score (ascending); empty once the game is over."""
    scores = move_scores(board, player)
    best = max(scores)
    return () if best == ILLEGAL_SCORE else tuple(i for i, s in enumerate(scores) if s == best)


def is_nontrivial(board: Board) -> bool:
    """True when some legal move is not optimal (so the choice matters)."""
    return len(optimal_moves(board)) < len(legal_moves(board))


def response_score(board: Board, text: str, player: Player | None = None) -> float:
    """`move_score` of a model response (parsed strictly with `parse_move`)."""
    return move_score(board, parse_move(text), player)


# ---------------------------------------------------------------------------------------------
# Text format


def board_rows(board: Board, *, style: Style = "numbers") -> str:
    """Three lines of cells; empty cells as their number 1-9 (`numbers`, `grid`, `letters`) or
    as `.` (`dots`). Cells are separated by spaces, or by `|` in the `grid` and `letters` styles,
    which byte-level BPE tokenizers split into one token per cell, the same token as the answer
    (`X|2|3`).

    `letters` names each mark by its cell *and* its owner, relative to the side to move: the
    mover's mark in cell k is the k-th lowercase letter (`a` for cell 1 ... `i` for cell 9), the
    opponent's the k-th uppercase one (`A` ... `I`). Each token then tells a model where a mark is
    and whose it is, without counting positions, and a position reads the same whichever side
    moves (`X........`, O to move, reads `A|2|3\n4|5|6\n7|8|9`). `compact` has the same rows;
    it differs from `letters` only in `board_prompt`."""
    check_board(board)
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if style in ("letters", "compact"):
        me = to_move(board)
        cells = [
            str(i + 1) if c == "." else (_MINE if c == me else _THEIRS)[i]
            for i, c in enumerate(board)
        ]
    else:
        cells = [c if c != "." or style == "dots" else str(i + 1) for i, c in enumerate(board)]
    sep = " " if style in ("numbers", "dots") else "|"
    return "\n".join(sep.join(cells[r : r + 3]) for r in (0, 3, 6))


def board_prompt(board: Board, *, style: Style = "numbers") -> str:
    """The plain-text prompt: `Board:`, three rows, then `You are X. Your move:` (the side to
    move, `to_move(board)`). The expected answer is one cell number, e.g. `5`.

    The `compact` style is the three `letters` rows alone, each ended by a newline
    (`a|2|C\n4|5|6\n7|8|9\n`): the letters already say whose each mark is relative to the mover,
    so the header and the side-to-move line add no information, and leaving them out makes the
    prompt 18 tokens instead of 28 with the tiny tokenizer (training and collection cost scale
    with it). The final newline keeps a digit answer from merging with a digit cell (`9` + `5`)."""
    rows = board_rows(board, style=style)
    if style == "compact":
        return rows + "\n"
    return f"Board:\n{rows}\nYou are {to_move(board)}. Your move:"


def board_messages(
    board: Board, *, style: Style = "numbers", system: str | None = None
) -> list[Message]:
    """The chat variant: an optional system message, then a user message with `board_prompt`."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    return [*messages, {"role": "user", "content": board_prompt(board, style=style)}]


def parse_board_prompt(prompt: str | Sequence[Message]) -> Board:
    """The board in a `board_prompt` (any style) or in the last message of `board_messages`.

    Raises `ValueError` if the text is not in that format or names the wrong side to move."""
    text = prompt if isinstance(prompt, str) else (prompt[-1]["content"] if prompt else "")
    lines = text.split("\n")
    compact = len(lines) == 4 and lines[3] == "" and "|" in lines[0]
    if compact:  # the compact style: the letters rows alone, each ended by a newline
        lines = ["Board:", *lines[:3], ""]
    ok = len(lines) == 5 and lines[0] == "Board:"
    cells = [] if not ok else [c for line in lines[1:4] for c in line.replace("|", " ").split(" ")]
    ok = ok and len(cells) == 9 and all(len(line) == 5 for line in lines[1:4])
    if compact:
        ok = ok and all(line[1] == line[3] == "|" for line in lines[1:4])
    if ok and (compact or any(c in _MINE or c in _THEIRS for c in cells)):  # letters / compact
        mine = sum(c in _MINE for c in cells)
        theirs = sum(c in _THEIRS for c in cells)
        me = "X" if mine == theirs else "O"  # X moves when both sides have as many marks
        marks = {c: me for c in _MINE} | {c: other(me) for c in _THEIRS}
        board = "".join(
            "." if c == str(i + 1) else marks[c] if c in (_MINE[i], _THEIRS[i]) else "?"
            for i, c in enumerate(cells)
        )
        ok = theirs in (mine, mine + 1)
    else:
        board = "".join(
            "." if c in (".", str(i + 1)) else c if c in ("X", "O") else "?"
            for i, c in enumerate(cells)
        )
    if not ok or not _VALID_BOARD.fullmatch(board):
        raise ValueError(f"not a board prompt: {text!r}")
    if not compact and lines[4] != f"You are {to_move(board)}. Your move:":
        raise ValueError(f"prompt names the wrong side to move: {lines[4]!r}")
    return board


def move_text(cell: int) -> str:
    """The canonical response for a 0-based cell: its number 1-9 as text."""
    if not 0 <= cell < 9:
        raise ValueError(f"cell must be in 0..8, got {cell}")
    return str(cell + 1)


def parse_move(text: str) -> int | None:
    """The 0-based cell of a response that is exactly one digit 1-9, optionally surrounded by
    whitespace; None for anything else (which scores as illegal)."""
    match = _MOVE.fullmatch(text) if isinstance(text, str) else None
    return None if match is None else int(match.group(1)) - 1


# ---------------------------------------------------------------------------------------------
# Players


def random_policy(rng: np.random.Generator) -> Policy:
    """A player choosing uniformly among the legal moves with `rng` (seeded by the caller)."""

    def choose(board: Board) -> str:
        moves = legal_moves(board)
        if not moves:
            raise ValueError(f"no legal move on a finished board {board!r}")
        return move_text(moves[int(rng.integers(len(moves)))])

    return choose


def perfect_policy(board: Board) -> str:
    """The deterministic perfect player: the first optimal move in cell order."""
    moves = optimal_moves(board)
    if not moves:
        raise ValueError(f"no legal move on a finished board {board!r}")
    return move_text(moves[0])


def text_policy(
    choose: Callable[[str | list[Message]], str],
    *,
    style: Style = "numbers",
    chat: bool = False,
    system: str | None = None,
) -> Policy:
    """A `Policy` from a function of the prompt text (or chat messages when `chat=True`)."""

    def policy(board: Board) -> str:
        if chat:
            return choose(board_messages(board, style=style, system=system))
        return choose(board_prompt(board, style=style))

    return policy


def batched(policy: Policy) -> BatchPolicy:
    """A `BatchPolicy` calling `policy` on each board in turn."""
    return lambda boards: [policy(board) for board in boards]


# ---------------------------------------------------------------------------------------------
# Games


@dataclass(frozen=True, slots=True)
class Turn:
    """One move of a game: the board before it, the mover, the response text and its cell."""

    board: Board
    player: Player
    text: str
    cell: int | None
    """0-based cell, or None when the response was illegal (the mover forfeits)."""


@dataclass(frozen=True, slots=True)
class GameRecord:
    """A finished game. An illegal response ends the game: its mover forfeits and loses."""

    turns: tuple[Turn, ...]
    final_board: Board
    winner: Player | None
    forfeit: Player | None = None

    def result_for(self, player: Player) -> Literal["win", "draw", "loss"]:
        """The result from `player`'s side."""
        if self.winner is None:
            return "draw"
        return "win" if self.winner == player else "loss"


def play_games(
    x: BatchPolicy, o: BatchPolicy, num_games: int, *, start: Board = EMPTY_BOARD
) -> list[GameRecord]:
    """Plays `num_games` games from `start` in lockstep: at each ply one call of the mover's
    batched policy covers every unfinished game. Self-play: pass the same policy as `x` and `o`."""
    check_board(start)
    players = {"X": x, "O": o}
    boards = [start] * num_games
    turns: list[list[Turn]] = [[] for _ in range(num_games)]
    forfeits: list[Player | None] = [None] * num_games
    active = [i for i in range(num_games) if not is_terminal(start)]
    while active:
        mover = to_move(boards[active[0]])
        texts = players[mover]([boards[i] for i in active])
        if len(texts) != len(active):
            raise ValueError(f"policy returned {len(texts)} moves for {len(active)} boards")
        still = []
        for i, text in zip(active, texts, strict=True):
            cell = parse_move(text)
            if cell not in legal_moves(boards[i]):
                cell = None
            turns[i].append(Turn(boards[i], mover, text, cell))
            if cell is None:
                forfeits[i] = mover
                continue
            boards[i] = boards[i][:cell] + mover + boards[i][cell + 1 :]
            if not is_terminal(boards[i]):
                still.append(i)
        active = still
    return [
        GameRecord(
            turns=tuple(turns[i]),
            final_board=boards[i],
            winner=other(forfeits[i]) if forfeits[i] else winner(boards[i]),
            forfeit=forfeits[i],
        )
        for i in range(num_games)
    ]


def play_game(x: Policy, o: Policy, *, start: Board = EMPTY_BOARD) -> GameRecord:
    """One game between two (unbatched) policies."""
    return play_games(batched(x), batched(o), 1, start=start)[0]
