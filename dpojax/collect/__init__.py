"""On-policy collection: the KV-cache sampler, the workflow protocol and runner, built-in workflows.

The built-in tic-tac-toe game (rules, exact minimax scorer, text format, opponents, evaluation and
TTC event emission) lives in `dpojax.collect.tictactoe` and `dpojax.collect.tictactoe_eval`.
"""
