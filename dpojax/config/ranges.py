"""The allowed range of every numeric key of the config tree, and the check of a config against
them (`range_problems`): a value outside its range (a negative clipping norm, a negative final
learning rate, alpha 0, a negative vocabulary chunk) and any non-finite number (`nan`, `inf`) is
refused before any compute, naming the key and the range. docs/config.md shows each key's range
(`dpojax.config.reference`). The `customizer.*` keys and a workflow's own options are checked by
their owners (`settings_problems`, `option_problems`); their numbers must be finite here too."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dpojax import schema
from dpojax.config.tree import Config
from dpojax.schema import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range

# float32's smallest normal number: a smaller epsilon is a denormal, which accelerators flush to 0.
ADAM_EPS = Range(
    1.1754943508222875e-38,
    why="Adam divides each update by sqrt(v) + eps: eps 0 (or a denormal, flushed to 0 on "
    "accelerators) makes it 0/0 = NaN for every parameter whose gradient is 0",
)

# The keys whose owners do not declare their ranges on the fields (`schema.setting(range=)`).
_TABLE: dict[str, Range] = {
    "seed": NON_NEGATIVE,
    "compilation_cache_min_seconds": NON_NEGATIVE,
    "data.max_length": Range(2),
    "data.unpaired.top_k": NON_NEGATIVE,
    "reference.sync_every": NON_NEGATIVE,
    "reference.sync_alpha": Range(
        0, 1, low_open=True, why="alpha 0 would never move the reference (sync_every=0 is off)"
    ),
    "optim.learning_rate": POSITIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.warmup_ratio": FRACTION,
    "optim.min_lr_ratio": FRACTION,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.b1": Range(0, 1, high_open=True),
    "optim.b2": Range(0, 1, high_open=True),
    "optim.eps": ADAM_EPS,
    "optim.max_grad_norm": NON_NEGATIVE,
    "train.steps": NON_NEGATIVE,
    "train.epochs": NON_NEGATIVE,
    "train.batch_size": AT_LEAST_ONE,
    "train.grad_accum": AT_LEAST_ONE,
    "train.eval_every": NON_NEGATIVE,
    "train.eval_batch_size": AT_LEAST_ONE,
    "train.log_every": AT_LEAST_ONE,
    "train.vocab_chunk": NON_NEGATIVE,
    "export.step": NON_NEGATIVE,
    "train.step_timeout_seconds": NON_NEGATIVE,
    "train.usable_memory_gib": NON_NEGATIVE,
    "train.prefetch_steps": NON_NEGATIVE,
    "train.early_stopping_patience": NON_NEGATIVE,
    "train.early_stopping_threshold": NON_NEGATIVE,
    "train.log_completions_every": NON_NEGATIVE,
    "train.log_completions_count": AT_LEAST_ONE,
    "train.log_completions_max_tokens": AT_LEAST_ONE,
    "checkpoint.every_steps": AT_LEAST_ONE,
    "checkpoint.max_to_keep": AT_LEAST_ONE,
    "collect.num_runs": AT_LEAST_ONE,
    "collect.temperature": NON_NEGATIVE,
    "collect.top_k": NON_NEGATIVE,
    "collect.top_p": Range(0, 1, low_open=True),
    "collect.max_new_tokens": AT_LEAST_ONE,
    "collect.eval_max_new_tokens": NON_NEGATIVE,
    "collect.min_score_diff": NON_NEGATIVE,
    "collect.max_pairs_per_turn": NON_NEGATIVE,
    "collect.max_pairs": NON_NEGATIVE,
    "loop.rounds": AT_LEAST_ONE,
    "loop.replay_rounds": Range(0, also=(-1,)),
    "loop.max_train_pairs": NON_NEGATIVE,
    "loop.max_wall_seconds": NON_NEGATIVE,
    "loop.init_seed": NON_NEGATIVE,
    "loop.gate_rounds": NON_NEGATIVE,
    "distributed.num_processes": NON_NEGATIVE,
    "distributed.process_id": Range(0, also=(-1,)),
    "distributed.initialization_timeout": AT_LEAST_ONE,
    "distributed.heartbeat_timeout_seconds": AT_LEAST_ONE,
    "plan.rows": NON_NEGATIVE,
    "plan.row_length": NON_NEGATIVE,
    "plan.completion_fraction": Range(0, 1, low_open=True, high_open=True),
    "plan.max_candidates": AT_LEAST_ONE,
}
# Every numeric key's range: the table's and those the settings groups declare on their fields
# (the loss settings, `dpojax.train.loss_settings`; the model and LoRA settings,
# `dpojax.models.model_settings`).
RANGES: dict[str, Range] = {
    **_TABLE,
    **{key.name: key.range for key in schema.keys(Config) if key.range is not None},
}


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def range_problems(values: Mapping[str, Any]) -> list[str]:
    """One line per non-finite number and per number outside its range (`values`: dotted key ->
    value, every leaf of a config)."""
    errors = []
    for name, value in values.items():
        if isinstance(value, list | tuple) and any(
            isinstance(v, float) and not math.isfinite(v) for v in value
        ):
            errors.append(f"config key '{name}' must hold finite numbers, got {value!r}")
    for name, value in _numbers(values).items():
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"config key '{name}' must be a finite number, got {value!r}")
        elif name in RANGES and value not in RANGES[name]:
            why = f" ({RANGES[name].why})" if RANGES[name].why else ""
            errors.append(f"config key '{name}' must be {RANGES[name].text()}, got {value!r}{why}")
    return errors
