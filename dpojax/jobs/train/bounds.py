"""Sizes bounded before any allocation: a few extra zeros on the command line must not take down
a shared host.

Before a job loads its model, tokenizes a pair or compiles its step (`train.auto_fit` builds a
batch of the recipe's size on the host), `check_sizes` refuses, naming the key and the fix:
rows longer than the model's positions (`data.max_length` against config.json's
`max_position_embeddings`), an adapter wider than the model (`lora.rank` against `hidden_size`),
and a batch whose host arrays alone would not fit the host's available memory
(`train.batch_size`, `train.eval_batch_size`). `mode=plan` checks the same against its planned
model (`plan.model_config` or model.path): it builds the recipe's batch on the host too. Once the
training pairs are read, `batch_problem` refuses a batch larger than the pairs there are (each
step would take all of them once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpojax.errors import ConfigErrors, ConfigProblem
from dpojax.hardware import memory
from dpojax.models.hf import read_config
from dpojax.models.hub import resolve_model_dir

# Host bytes per token of one batch as the layouts build it (token ids, positions, segment ids,
# completion masks and the pairs behind them, a few int32 arrays each): a generous figure, so
# that only sizes far beyond any real run are refused by it.
HOST_BYTES_PER_TOKEN = 64


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def size_problems(
    config: Any, *, positions: int, width: int, host_bytes: int | None, model: str = "the model"
) -> list[str]:
    """One line per size of `config` beyond the model's `positions` and `width` or, for one
    batch's host arrays, beyond `host_bytes` (None: not known, not checked)."""
    d, t, rank = config.data, config.train, config.lora.rank
    errors = []
    if d.max_length > positions:
        errors.append(
            f"config key 'data.max_length' ({d.max_length}) is longer than the {positions} "
            f"positions of {model} (config.json max_position_embeddings); set it to at most "
            f"{positions}"
        )
    if rank > width:
        errors.append(
            f"config key 'lora.rank' ({rank}) is larger than the width of {model} "
            f"(config.json hidden_size {width}), so the adapter is no low-rank update; use at "
            f"most {width} (8-64 is usual), or lora.rank=0 to train every weight"
        )
    for key, pairs in (
        ("train.batch_size", t.batch_size),
        ("train.eval_batch_size", t.eval_batch_size),
    ):
        need = pairs * 2 * d.max_length * HOST_BYTES_PER_TOKEN
        if host_bytes is not None and need > host_bytes:
            errors.append(
                f"config key '{key}' ({pairs} pairs of up to {d.max_length} tokens, "
                f"data.max_length): one batch's host arrays alone would take about {_gib(need)} "
                f"and the host has {_gib(host_bytes)} available; lower {key} (pairs per step, "
                "over all hosts) or data.max_length"
            )
    return errors


def _host_bytes() -> int | None:
    try:
        return int(memory.host_usable(1.0).bytes)
    except RuntimeError:  # the host's figures cannot be read: not checked here
        return None


def check_sizes(config: Any, source: str | Path | None = None) -> None:
    """`ConfigErrors` for every size of `config` beyond its model (the config.json of `source`,
    a model directory or a Hub id; model.path by default) or the host's available memory; reads
    nothing but the model's config.json. A config.json that names no max_position_embeddings
    bounds no row length."""
    path = resolve_model_dir(source or config.model.path)
    model = read_config(path)
    names_positions = "max_position_embeddings" in (path / "config.json").read_text()
    errors = size_problems(
        config,
        positions=model.max_position_embeddings if names_positions else config.data.max_length,
        width=model.hidden_size,
        host_bytes=_host_bytes(),
        model=str(path),
    )
    if errors:
        raise ConfigErrors(errors)


def batch_problem(batch_size: int, pairs: int, source: str) -> ConfigProblem | None:
    """The error for a training batch larger than the `pairs` read from `source` (None: it is
    not)."""
    if batch_size <= pairs:
        return None
    return ConfigProblem(
        f"config key 'train.batch_size' ({batch_size}) is larger than the {pairs} training "
        f"pairs of {source}: every step would take all of them and the batch would never be "
        f"full; set --config.train.batch_size to at most {pairs}, or train on more pairs"
    )
