"""Built-in workflows, each a package with its game or task, scorer, evaluation and options.

A recipe registers its workflow through the `dpojax.workflows` entry-point group in
pyproject.toml, as any other package can; dpojax's framework code names none of them.
"""
