"""Tic-tac-toe, the embedded default: the game with an exact minimax scorer and text formats
(`game`), the evaluation of a greedy policy and the TTC events of scored candidates
(`evaluation`), and the workflow with its options (`workflow`). docs/tictactoe.md describes
them."""
