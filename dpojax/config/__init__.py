"""The config: every key of a run, typed, documented and validated once before any compute.

| module | holds |
|---|---|
| `tree` | the settings tree (`Config` and its groups), `default_config()`, `check_keys`, `frozen(config)`: the typed, frozen view a job receives |
| `checks` | `validate(config)`: the checks across keys, paths and devices |
| `modes` | the modes of `config.mode`: one `Mode` record each (job, `--help` line, outputs, line after a signal) |
| `reference` | docs/config.md (`python -m dpojax.config > docs/config.md`) |
| `recipes` | the shipped recipes by name (`configs/`, installed as `dpojax.recipes`): `--config train_pairs`, `api.config("train_pairs")` |

Recipes (`configs/*.py`) start from `default_config()` and change what they need, so every key
can be overridden on the command line (`--config.optim.learning_rate=1e-5`) and a misspelt key
is refused. The config imports no job: jobs import it.
"""

from dpojax.config.checks import validate
from dpojax.config.modes import MODE_RECORDS, MODES
from dpojax.config.reference import reference_page
from dpojax.config.tree import Config, all_keys, check_keys, default_config, frozen

__all__ = [
    "MODE_RECORDS",
    "MODES",
    "Config",
    "all_keys",
    "check_keys",
    "default_config",
    "frozen",
    "reference_page",
    "validate",
]
