"""The shipped recipes: each `<name>.py` here defines `get_config()`, the defaults of
`dpojax.config.default_config()` changed for one kind of run. The installed package carries them
as `dpojax.recipes` (pyproject.toml maps that package to this folder), so a recipe is named with
`--config <name>` or `dpojax.api.config("<name>")` outside a clone too; in a clone
`--config configs/<name>.py` names the same file. `models/` holds the model configs that the
`mode=plan` recipes read relative to themselves."""
