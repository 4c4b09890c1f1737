"""Alias of `dpojax.workflows.tictactoe` (see `dpojax.recipes`)."""
