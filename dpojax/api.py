"""The Python API: the command line's jobs from a notebook or a script, on the same code path
(`dpojax.jobs.run`: the same validation, workdir layout, checkpoints, resumption and outputs).

    from dpojax import api

    config = api.config("configs/tiny_test.py", {"model.path": "runs/tiny-llama",
                                                  "data.train_path": "pairs.jsonl",
                                                  "lora.rank": 8})
    summary = api.train(config, "runs/mine", callback=lambda step, total, m, e: print(step))
    # or objects with hooks (on_step_end, on_evaluate, ...) that may return api.STOP / EVALUATE
    summary = api.train(config, "runs/mine", callbacks=[api.EarlyStopping("loss", patience=3)])
    api.evaluate("runs/mine")            # the run's own config.json, like the command line
    path = api.export("runs/mine")       # -> Path("runs/mine/export")
    for record in api.metrics("runs/mine"):
        ...

A config is an `ml_collections.ConfigDict`: change it as `config.lora.rank = 8` or with dotted
keys in `api.config(..., overrides)`. Errors are the command line's (`dpojax.errors`): a bad
config raises `ConfigErrors` listing every problem. docs/python_api.md has the whole story.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_collections

from dpojax import schema
from dpojax.config import all_keys, check_keys, default_config, recipes
from dpojax.errors import ConfigErrors, ConfigProblem
from dpojax.jobs import run
from dpojax.jobs.train.callbacks import EVALUATE, FINISH, STOP, Callback, Control, EarlyStopping
from dpojax.jobs.workdir import CONFIG_FILE, SAVED_SUFFIXES, remote, saved_config

__all__ = [
    "EVALUATE",
    "FINISH",
    "STOP",
    "Callback",
    "Control",
    "EarlyStopping",
    "config",
    "evaluate",
    "export",
    "metrics",
    "plan",
    "train",
]

if TYPE_CHECKING:
    from dpojax.jobs.train.step_loop import StepCallback


def _recipe(path: Path) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(f"dpojax_recipe_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigProblem(f"{path}: cannot load this recipe (a .py file with get_config())")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigProblem(f"{path}: a recipe defines get_config(); this file does not")
    return module.get_config()


def config(
    source: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None
) -> ml_collections.ConfigDict:
    """A config: the defaults (no `source`), a recipe file (configs/*.py) or a shipped recipe
    by name ("train_pairs": `dpojax.config.recipes`; a file of that name here wins), a saved
    config (a run's config.json, or a .json / .yaml file) or a run's workdir (its config.json),
    with `overrides` ({"lora.rank": 8, ...}: dotted keys, as `--config.<key>=<value>`) on top."""
    if source is None:
        out = default_config()
    else:
        path = recipes.source(source)
        is_saved = path.is_dir() or path.suffix in SAVED_SUFFIXES
        out = saved_config(path) if is_saved else _recipe(path)
    overrides = dict(overrides or {})
    errors = schema.check_values(overrides, all_keys(), label="override")
    if errors:
        raise ConfigErrors(errors)
    for key, value in overrides.items():
        *groups, name = key.split(".")
        node = out
        for part in groups:
            node = node[part]
        node[name] = tuple(value) if isinstance(node[name], tuple) else value
    errors = check_keys(out)
    if errors:
        raise ConfigErrors(errors)
    return out


def _local(workdir: str | os.PathLike) -> Path:
    """`workdir`, or for a gs:// (s3://, ...) URL its local mirror, pulled from the bucket."""
    return remote.pulled(os.fspath(workdir)) if remote.is_url(workdir) else Path(workdir)


def _for_mode(
    mode: str, workdir: str | os.PathLike, cfg: ml_collections.ConfigDict | None
) -> ml_collections.ConfigDict:
    """`cfg` (default: the run's own, WORKDIR/config.json) set to `mode`."""
    if cfg is None:
        local = _local(workdir)
        if not (local / CONFIG_FILE).is_file():
            raise ConfigProblem(
                f"{workdir} holds no {CONFIG_FILE}: pass a config (dpojax.api.config(...))"
            )
        cfg = saved_config(local)
    cfg = ml_collections.ConfigDict(cfg.to_dict())  # the caller's config stays as it was
    cfg.mode = mode
    return cfg


def train(
    cfg: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    callback: StepCallback | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Trains (resuming the workdir's run) and returns summary.json's contents.
    `callback(step, total_steps, train_metrics, eval_metrics_or_None)` runs after every step;
    an exception it raises ends the run there (a checkpoint is kept). `callbacks`: objects with
    any of on_train_begin(step, total_steps), on_step_end(step, metrics), on_evaluate(step,
    metrics), on_save(step, path), on_train_end(summary) (process 0 only); a hook may return
    `STOP` (the run ends with a checkpoint, resumable: status "stopped by callback <name>"),
    `FINISH` (training ends there as a completed run, with its exports) or `EVALUATE` (an
    evaluation at the next step boundary). docs/python_api.md, "Callbacks"."""
    options: dict[str, Any] = {"callback": callback}
    if callbacks:
        options["callbacks"] = list(callbacks)
    return run(_for_mode("train", workdir, cfg), workdir, **options)


def evaluate(
    workdir: str | os.PathLike, cfg: ml_collections.ConfigDict | None = None
) -> dict[str, float]:
    """Metrics of the workdir's latest checkpoint on the evaluation pairs (per-pair results in
    WORKDIR/evaluate/pairs.jsonl). `cfg`: default the run's own config."""
    return run(_for_mode("evaluate", workdir, cfg), workdir)


def export(workdir: str | os.PathLike, cfg: ml_collections.ConfigDict | None = None) -> Path:
    """The workdir's latest checkpoint as a Hugging Face directory; returns its path
    (WORKDIR/export; LoRA adapters also in WORKDIR/export/adapter; for a gs:// workdir, the
    local mirror's copy of what is in the bucket)."""
    return Path(run(_for_mode("export", workdir, cfg), workdir))


def plan(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict[str, Any]:
    """The step compiled ahead of time for `plan.target` (memory, FLOPs, roofline), as also
    written to WORKDIR/plan.json (docs/plan.md)."""
    return run(_for_mode("plan", workdir, cfg), workdir)


def metrics(workdir: str | os.PathLike, split: str | None = None) -> Iterator[dict[str, Any]]:
    """The records of WORKDIR/metrics.jsonl (each with step, split and the metrics), in order;
    only those of `split` ("train" or "eval") when given."""
    path = _local(workdir) / "metrics.jsonl"
    if not path.is_file():
        return
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if split is None or record.get("split") == split:
                yield record
