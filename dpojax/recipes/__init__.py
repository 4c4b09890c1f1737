"""Alias of `dpojax.workflows` (the built-in workflows' package was named `recipes` before
"recipe" came to mean only the config files in `configs/`). It keeps the entry point
`dpojax.recipes.tictactoe.workflow:TicTacToeWorkflow` of installs made before the rename working
until they are reinstalled; kept for one release."""
