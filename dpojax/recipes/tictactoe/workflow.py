"""Alias of `dpojax.workflows.tictactoe.workflow` (see `dpojax.recipes`)."""

from dpojax.workflows.tictactoe.workflow import TicTacToeWorkflow

__all__ = ["TicTacToeWorkflow"]
