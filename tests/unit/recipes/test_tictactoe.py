"""Tic-tac-toe: rules, position counts, the exact scorer vs brute force, text format, players."""

import numpy as np
import pytest

from dpojax.workflows.tictactoe import game as ttt
from dpojax.workflows.tictactoe.game import (
    EMPTY_BOARD,
    apply_move,
    batched,
    board_messages,
    board_prompt,
    is_nontrivial,
    is_terminal,
    legal_moves,
    move_score,
    move_scores,
    move_text,
    optimal_moves,
    parse_board_prompt,
    parse_move,
    perfect_policy,
    play_game,
    play_games,
    position_value,
    random_policy,
    reachable_positions,
    response_score,
    to_move,
    winner,
)

# ---------------------------------------------------------------------------------------------
# Rules and counts


def test_rules():
    assert to_move(EMPTY_BOARD) == "X" and to_move("X........") == "O"
    assert winner("XXXOO....") == "X" and winner("XXOOOOX.X") == "O" and winner("X.O.X.O.X") == "X"
    assert winner("XOXXOOOXX") is None and is_terminal("XOXXOOOXX")
    assert legal_moves("X...O...X") == (1, 2, 3, 5, 6, 7) and legal_moves("XXXOO....") == ()
    assert apply_move("X...O...X", 2) == "X.O.O...X"
    assert apply_move(EMPTY_BOARD, 4, "O") == "....O...."
    for cell in (0, 9, -1):
        with pytest.raises(ValueError, match="illegal move"):
            apply_move("X........", cell)
    for bad in ("", "X" * 8, "x........", "X.......-", None):
        with pytest.raises(ValueError, match="9 characters"):
            position_value(bad)


def test_reachable_position_counts():
    boards = reachable_positions()
    everything = reachable_positions(include_terminal=True)
    assert len(boards) == 4520 and len(set(boards)) == 4520
    assert len(everything) == 5478 and everything[0] == EMPTY_BOARD
    terminal = [b for b in everything if is_terminal(b)]
    assert len(terminal) == 958
    assert [sum(winner(b) == w for b in terminal) for w in ("X", "O", None)] == [626, 316, 16]
    assert sum(map(is_nontrivial, boards)) == 3191


# ---------------------------------------------------------------------------------------------
# Scorer

_LINES = [sum(1 << i for i in line) for line in ttt.WIN_LINES]


def _negamax(me: int, opp: int) -> int:
    """Brute force, no memo, on bitmasks: +1 win, 0 draw, -1 loss for the side to move (`me`)."""
    if any(opp & line == line for line in _LINES):
        return -1
    free = ~(me | opp) & 0x1FF
    if not free:
        return 0
    best = -1
    for i in range(9):
        if free >> i & 1:
            best = max(best, -_negamax(opp, me | 1 << i))
            if best == 1:  # nothing beats a win: stopping here is still exact
                break
    return best


def _masks(board: str, player: str) -> tuple[int, int]:
    me = sum(1 << i for i, c in enumerate(board) if c == player)
    opp = sum(1 << i for i, c in enumerate(board) if c not in (player, "."))
    return me, opp


def test_scorer_is_exact_on_every_reachable_position():
    checked = 0
    for board in reachable_positions():
        player = to_move(board)
        me, opp = _masks(board, player)
        scores = move_scores(board)
        for cell in range(9):
            if board[cell] != ".":
                assert scores[cell] == -1.0
                continue
            expected = (1 - _negamax(opp, me | 1 << cell)) / 2
            assert scores[cell] == expected, (board, cell)
            checked += 1
        assert position_value(board) == (_negamax(me, opp) + 1) / 2
        assert position_value(board) == max(scores)
    assert checked == 16167


def test_known_values():
    assert position_value(EMPTY_BOARD) == 0.5 and set(move_scores(EMPTY_BOARD)) == {0.5}
    # Against a corner opening only the centre draws.
    assert move_scores("X........") == (-1.0, 0, 0, 0, 0.5, 0, 0, 0, 0)
    # X completes the row; blocking O's row draws; anything else loses.
    assert move_scores("XX.OO....") == (-1, -1, 1.0, -1, -1, 0.5, 0, 0, 0)
    assert optimal_moves("XX.OO....") == (2,) and perfect_policy("XX.OO....") == "3"
    assert position_value("XXXOO....") == 0.0 and position_value("XOXXOOOXX") == 0.5


def test_values_depend_on_perspective_not_on_call_order():
    """Either side may be asked to move on the same board; the memo never mixes them up."""
    keys = [(b, p) for b in reachable_positions()[::3] for p in ("X", "O")]
    ttt._value.cache_clear()
    forward = {key: position_value(*key) for key in keys}
    ttt._value.cache_clear()
    backward = {key: position_value(*key) for key in reversed(keys)}
    assert forward == backward
    assert forward == {(b, p): (_negamax(*_masks(b, p)) + 1) / 2 for b, p in keys}
    assert position_value("XX.OO....", "X") == position_value("XX.OO....", "O") == 1.0


def test_illegal_moves_score_minus_one():
    assert move_score("X........", 0) == -1.0
    assert move_score("X........", None) == -1.0
    assert move_score("X........", 9) == -1.0 and move_score("X........", -1) == -1.0
    assert move_score("XXXOO....", 5) == -1.0  # game over
    assert response_score("X........", " 5\n") == 0.5
    assert response_score("X........", "1") == -1.0 and response_score("X........", "ten") == -1.0


# ---------------------------------------------------------------------------------------------
# Text format


def test_prompt_format():
    board = "X...O...X"
    assert board_prompt(board) == "Board:\nX 2 3\n4 O 6\n7 8 X\nYou are O. Your move:"
    assert board_prompt(board, style="dots") == "Board:\nX . .\n. O .\n. . X\nYou are O. Your move:"
    assert board_messages(board) == [{"role": "user", "content": board_prompt(board)}]
    system, user = board_messages(board, system="Play.", style="dots")
    assert system == {"role": "system", "content": "Play."}
    assert user["content"] == board_prompt(board, style="dots")
    with pytest.raises(ValueError, match="style"):
        board_prompt(board, style="hex")


def test_prompt_round_trip_on_every_position():
    for board in reachable_positions(include_terminal=True):
        assert parse_board_prompt(board_prompt(board)) == board
        assert parse_board_prompt(board_prompt(board, style="dots")) == board
        assert parse_board_prompt(board_prompt(board, style="letters")) == board
        assert parse_board_prompt(board_prompt(board, style="compact")) == board
        assert parse_board_prompt(board_messages(board, system="s")) == board


@pytest.mark.parametrize(
    "text",
    [
        "",
        "X 2 3\n4 O 6\n7 8 X\nYou are O. Your move:",
        "Board:\nX 2 3\n4 O 6\n7 8 X\nYou are X. Your move:",  # wrong side to move
        "Board:\nX 2 3\n4 O 6\n7 9 X\nYou are O. Your move:",  # wrong cell number
        "Board:\nX 2 3\n4 O 6\n7 8 X \nYou are O. Your move:",
        "Board:\nX23\n4O6\n78X\nYou are O. Your move:",
        "Board:\nX 2 3\n4 O 6\n7 8 X\nYou are O. Your move: ",
    ],
)
def test_parse_board_prompt_rejects(text):
    with pytest.raises(ValueError):
        parse_board_prompt(text)


@pytest.mark.parametrize("text, cell", [("5", 4), ("1", 0), ("9", 8), (" 5\n", 4), ("\t7  ", 6)])
def test_parse_move(text, cell):
    assert parse_move(text) == cell
    assert parse_move(move_text(cell)) == cell


@pytest.mark.parametrize(
    "text",
    ["", " ", "0", "10", "55", "05", "5.", "+5", "5 6", "five", "cell 5", "<move>5</move>",
     "５", "٥", "5<|eos|>", None, 5],
)  # fmt: skip
def test_parse_move_rejects(text):
    assert parse_move(text) is None


def test_move_text():
    assert [move_text(c) for c in range(9)] == [str(n) for n in range(1, 10)]
    with pytest.raises(ValueError):
        move_text(9)


def test_tiny_tokenizer_gives_one_token_per_cell():
    from dpojax.models.tiny import build_tokenizer

    tok = build_tokenizer()
    lengths = []
    for board in reachable_positions()[::10]:
        ids = tok(board_prompt(board))["input_ids"]
        lengths.append(len(ids))
        pieces = [tok.decode([i]).strip() for i in tok(ttt.board_rows(board))["input_ids"][1:]]
        assert [p for p in pieces if p] == [c if c != "." else str(i + 1) for i, c in
                                           enumerate(board)]  # fmt: skip
    assert max(lengths) <= 27  # 23-27 tokens with BOS over all 4,520 positions
    assert all(len(tok(move_text(c), add_special_tokens=False)["input_ids"]) == 1 for c in range(9))


# ---------------------------------------------------------------------------------------------
# Players and games


def test_random_policy_is_seeded_and_legal():
    a, b = random_policy(np.random.default_rng(3)), random_policy(np.random.default_rng(3))
    boards = reachable_positions()[:300]
    moves = [a(board) for board in boards]
    assert moves == [b(board) for board in boards]
    assert all(parse_move(m) in legal_moves(board) for m, board in zip(moves, boards, strict=True))
    with pytest.raises(ValueError, match="finished"):
        a("XXXOO....")


def test_perfect_player_never_loses_to_random():
    rand = batched(random_policy(np.random.default_rng(0)))
    perfect = batched(perfect_policy)
    as_x = play_games(perfect, rand, 300)
    as_o = play_games(rand, perfect, 300)
    assert all(g.result_for("X") != "loss" for g in as_x)
    assert all(g.result_for("O") != "loss" for g in as_o)
    assert sum(g.winner == "X" for g in as_x) > 250 and sum(g.winner == "O" for g in as_o) > 150
    assert all(g.forfeit is None and is_terminal(g.final_board) for g in as_x + as_o)


def test_perfect_self_play_draws():
    game = play_game(perfect_policy, perfect_policy)
    assert game.winner is None and game.result_for("X") == "draw" and "." not in game.final_board
    assert [t.player for t in game.turns] == list("XOXOXOXOX")
    assert all(t.text == move_text(t.cell) for t in game.turns)
    # From every reachable position, perfect self-play reaches the position's value.
    for board in reachable_positions()[::7]:
        end = play_game(perfect_policy, perfect_policy, start=board)
        assert (
            end.result_for(to_move(board))
            == {1.0: "win", 0.5: "draw", 0.0: "loss"}[position_value(board)]
        )


def test_illegal_move_forfeits_and_self_play_hook():
    center = lambda board: "5"
    game = play_game(center, perfect_policy)
    assert game.forfeit == "X" and game.winner == "O" and game.turns[-1].cell is None
    assert [t.text for t in game.turns] == ["5", "1", "5"]
    games = play_games(batched(center), batched(center), 3)
    assert all(g.forfeit == "O" and len(g.turns) == 2 for g in games)
    assert play_games(batched(center), batched(center), 2, start="XXXOO....")[0].turns == ()
    with pytest.raises(ValueError, match="returned 0 moves for 2"):
        play_games(lambda boards: [], batched(center), 2)


def test_grid_style_gives_one_token_per_cell_matching_the_answer_token():
    from dpojax.models.tiny import build_tokenizer
    from dpojax.workflows.tictactoe.game import board_prompt, parse_board_prompt

    tokenizer = build_tokenizer()
    board = "X...O...."
    prompt = board_prompt(board, style="grid")
    assert prompt.startswith("Board:\nX|2|3\n4|O|6\n7|8|9\n")
    assert parse_board_prompt(prompt) == board
    pieces = [tokenizer.decode([i]) for i in tokenizer(prompt)["input_ids"]]
    cells = [p for p in pieces if p in set("XO123456789")]
    assert cells == ["X", "2", "3", "4", "O", "6", "7", "8", "9"]
    answer = tokenizer("5")["input_ids"][-1]
    assert tokenizer.decode([answer]) == "5" and "5" not in cells  # and "5" is one token


def test_letters_style_names_cell_and_owner_relative_to_the_mover():
    from dpojax.models.tiny import build_tokenizer
    from dpojax.workflows.tictactoe.game import board_prompt, parse_board_prompt

    # The mover's marks are lowercase, the opponent's uppercase; the k-th letter is cell k.
    assert board_prompt("X...O...X", style="letters") == (
        "Board:\nA|2|3\n4|e|6\n7|8|I\nYou are O. Your move:"
    )
    assert board_prompt("XO..X..O.", style="letters") == (
        "Board:\na|B|3\n4|e|6\n7|H|9\nYou are X. Your move:"
    )
    tokenizer = build_tokenizer()
    prompt = board_prompt("X...O....", style="letters")
    pieces = [tokenizer.decode([i]) for i in tokenizer(prompt)["input_ids"]]
    rows = pieces[pieces.index("\n") + 1 : pieces.index("You")]
    # One token per cell; an empty cell is the same token as the answer naming it.
    assert "".join(rows) == "a|2|3\n4|E|6\n7|8|9\n" and len(rows) == 18
    assert tokenizer("5")["input_ids"][1:] == tokenizer("4|5|6")["input_ids"][3:4]
    for bad in (
        "Board:\nb|2|3\n4|E|6\n7|8|9\nYou are X. Your move:",  # letter in the wrong cell
        "Board:\na|2|3\n4|e|6\n7|8|9\nYou are O. Your move:",  # two marks of the mover's
        "Board:\na|2|3\n4|E|6\n7|8|9\nYou are O. Your move:",  # wrong side to move
        "Board:\na|2|3\n4|X|6\n7|8|9\nYou are O. Your move:",  # styles mixed
    ):
        with pytest.raises(ValueError):
            parse_board_prompt(bad)


def test_compact_style_is_the_letters_rows_alone_and_never_merges_with_the_answer():
    from dpojax.models.tiny import build_tokenizer
    from dpojax.workflows.tictactoe.game import board_prompt, parse_board_prompt

    assert board_prompt("X...O...X", style="compact") == "A|2|3\n4|e|6\n7|8|I\n"
    assert board_prompt("XO..X..O.", style="compact") == "a|B|3\n4|e|6\n7|H|9\n"
    tokenizer = build_tokenizer()
    compact = tokenizer(board_prompt("XO..X..O.", style="compact"))["input_ids"]
    letters = tokenizer(board_prompt("XO..X..O.", style="letters"))["input_ids"]
    assert (len(compact), len(letters)) == (19, 29)  # BOS + 9 cells + 6 bars + 3 newlines
    # Every legal answer appends exactly one token to every position's prompt: the final
    # newline keeps `9` + `5` from becoming the token `95`.
    for board in reachable_positions():
        prompt = board_prompt(board, style="compact")
        ids = tokenizer(prompt)["input_ids"]
        for cell in legal_moves(board):
            assert tokenizer(prompt + str(cell + 1))["input_ids"][:-1] == ids
    for bad in (
        "b|2|3\n4|E|6\n7|8|9\n",  # letter in the wrong cell
        "a|2|3\n4|e|6\n7|8|9\n",  # two marks of the mover's
        "a|2|3\n4|E|6\n7|8|9",  # no final newline
        "a 2 3\n4 E 6\n7 8 9\n",  # spaces instead of bars
        "a|2|3\n4|X|6\n7|8|9\n",  # styles mixed
    ):
        with pytest.raises(ValueError):
            parse_board_prompt(bad)


@pytest.mark.parametrize("up_to_legal, at_least", [(False, 1), (True, 1), (True, 2)])
def test_workflow_keeps_at_most_one_candidate_per_legal_move(up_to_legal, at_least):
    from collections import Counter

    from dpojax.workflows.tictactoe.game import parse_board_prompt
    from dpojax.workflows.tictactoe.workflow import TicTacToeWorkflow

    calls = []

    def generate(prompts, k):  # 8 distinct answers, cells 9, 8, ..., 2 (legal or not)
        calls.append(k)
        return [[str(9 - j) for j in range(k)] for _ in prompts]

    workflow = TicTacToeWorkflow(
        games=6,
        candidates=8,
        random_opening_plies=4,
        style="letters",
        candidates_up_to_legal=up_to_legal,
        min_candidates=at_least,
    )
    events = workflow.collect(generate, run_id="r", seed=3)
    assert set(calls) == {8}
    per_turn = Counter((e.example_id, e.turn_id) for e in events)
    boards = {(e.example_id, e.turn_id): parse_board_prompt(e.input) for e in events}
    for key, count in per_turn.items():
        legal = len(legal_moves(boards[key]))
        assert count == (max(min(8, legal), at_least) if up_to_legal else 8)
    assert (sum(per_turn.values()) < 8 * len(per_turn)) == up_to_legal
    for e in events:  # kept candidates are the first ones drawn: 9, 8, 7, ...
        assert e.output == str(9 - e.candidate_index)


def test_distinct_moves_keeps_the_first_answer_per_cell_in_canonical_form():
    from dpojax.workflows.tictactoe.workflow import distinct_moves

    assert distinct_moves(["6", " 6", "3", "x", " 3 ", "9\n", "6 ", "x"]) == [
        "6",
        "3",
        "x",
        "9",
        "x",
    ]
    assert distinct_moves([" 5", "5"]) == ["5"]
    assert distinct_moves([]) == []


@pytest.mark.parametrize("on", [False, True])
def test_workflow_with_distinct_moves_emits_one_candidate_per_cell(on):
    from collections import defaultdict

    from dpojax.workflows.tictactoe.workflow import TicTacToeWorkflow

    def generate(prompts, k):  # each cell twice: "9", " 9", "8", " 8", ...
        return [[(" " if j % 2 else "") + str(9 - j // 2) for j in range(k)] for _ in prompts]

    workflow = TicTacToeWorkflow(
        games=4, candidates=8, random_opening_plies=3, style="compact", distinct_moves=on
    )
    events = workflow.collect(generate, run_id="r", seed=1)
    per_turn = defaultdict(list)
    for e in events:
        per_turn[e.example_id, e.turn_id].append(e.output)
    for outputs in per_turn.values():
        if on:
            assert outputs == ["9", "8", "7", "6"]
        else:
            assert outputs == ["9", " 9", "8", " 8", "7", " 7", "6", " 6"]


def test_exploration_continues_games_with_random_moves():
    from collections import defaultdict

    from dpojax.workflows.tictactoe.game import move_scores, parse_board_prompt, position_value
    from dpojax.workflows.tictactoe.workflow import TicTacToeWorkflow

    def generate(prompts, k):  # every answer, so the best candidate is always an optimal move
        return [[str(c) for c in range(1, 10)][:k] for _ in prompts]

    def continuations(explore, seed=5):
        workflow = TicTacToeWorkflow(
            games=64, candidates=9, random_opening_plies=0, style="compact", explore=explore
        )
        turns = defaultdict(set)
        for e in workflow.collect(generate, run_id="r", seed=seed):
            turns[e.example_id].add(parse_board_prompt(e.input))
        blunders = 0  # decisions whose game went on with a move worse than the position's value
        for boards in turns.values():
            for board in boards:
                after = [
                    b
                    for b in boards
                    if b.count(".") == board.count(".") - 1
                    and sum(x != y for x, y in zip(board, b, strict=True)) == 1
                ]
                for b in after:
                    cell = next(i for i in range(9) if board[i] != b[i])
                    blunders += move_scores(board)[cell] < position_value(board)
        return blunders, turns

    none, turns = continuations(0.0)
    assert none == 0  # optimal play on both sides: every game a draw from the empty board
    some, _ = continuations(0.3)
    assert some > 10
    assert continuations(0.3) == continuations(0.3)  # seeded
    assert all("." * 9 in boards for boards in turns.values())
    with pytest.raises(ValueError, match="explore must be a probability"):
        TicTacToeWorkflow(explore=1.5)
    with pytest.raises(ValueError, match="min_candidates must be >= 1"):
        TicTacToeWorkflow(min_candidates=0)
