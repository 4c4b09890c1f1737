"""The embedded default: iterative on-policy DPO on tic-tac-toe, from a fresh random tiny model.

    python -m dpojax.main --config configs/tictactoe.py --workdir runs/tictactoe

No downloads: the tiny model and its tokenizer are built locally. Each round the policy plays
self-play games with 8 distinct scored candidates per move (at most one per legal move; exact
minimax scores), the candidates become preference pairs, and the policy trains on them against
the fixed initial model as reference. The board is shown in the `letters` style (`a|B|C`: one
token per cell, naming the cell and whether the mark is the mover's). Prints a before/after
table; writes WORKDIR/summary.json, report.md and export/.
"""

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.mode = "loop"
    config.seed = 0
    config.model.path = ""  # empty: a fresh random tiny model (loop.init_tiny_model)
    config.loop.init_tiny_model = "llama"
    config.loop.rounds = 12
    config.loop.reference = "initial"
    # Replay the pairs of every earlier round (their minimax labels stay exact), at most 20k a round.
    config.loop.replay_rounds = -1
    config.loop.max_train_pairs = 20_000
    config.collect.tictactoe.games = 512
    config.collect.tictactoe.candidates = 8
    config.collect.tictactoe.opponent = "self"
    config.collect.tictactoe.random_opening_plies = 6  # 0-6 random plies: varied positions
    config.collect.tictactoe.style = "letters"  # a|2|C: one token per cell naming cell and owner
    config.collect.tictactoe.candidates_up_to_legal = True  # no illegal fillers once play is legal
    config.collect.max_pairs_per_turn = 8
    config.collect.distinct = True
    config.collect.temperature = 1.0
    # A move is one token: candidates are single tokens (the training completion gets EOS
    # appended); the greedy evaluation generates 2 tokens, so a move counts as legal only when
    # the model also ends its answer (EOS) right after it.
    config.collect.max_new_tokens = 1
    config.collect.eval_max_new_tokens = 2
    config.collect.min_score_diff = 0.1  # ties teach nothing
    config.loss.type = "sigmoid"
    config.loss.beta = 0.5
    config.loss.sft_loss_weight = 0.1  # keeps the chosen move's EOS likely (NeMo's SFT term)
    config.optim.learning_rate = 2e-3
    config.optim.schedule = "constant"
    config.optim.name = "adamw"
    config.train.epochs = 1
    config.train.batch_size = 128
    config.train.progress = False
    config.data.max_length = 64
    config.data.layout = "prefix_shared"  # the board is computed once per pair
    config.checkpoint.every_steps = 100_000
    config.export.enabled = True
    config.mesh.data = -1
    return config
