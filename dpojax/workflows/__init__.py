"""Built-in workflows, each a package with its game or task, scorer, evaluation and options.

(A *recipe* is a config file in `configs/`; a *workflow* plays episodes and scores candidates.)
Each workflow here registers itself through the `dpojax.workflows` entry-point group in
pyproject.toml, as any other package can; dpojax's framework code names none of them.
"""
