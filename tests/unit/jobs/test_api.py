"""The Python API's config builder: defaults, a recipe, a saved config or a workdir, with dotted
overrides; bad overrides and a workdir without a run are refused with the key or the path; the
metrics iterator reads metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpojax import api
from dpojax.config import frozen
from dpojax.errors import ConfigErrors, ConfigProblem
from dpojax.jobs.workdir import check_config

ROOT = Path(__file__).resolve().parents[3]


def test_config_from_a_recipe_with_overrides():
    config = api.config(
        ROOT / "configs" / "tiny_test.py", {"lora.rank": 8, "lora.targets": ["q_proj"]}
    )
    assert config.train.steps == 6 and config.lora.rank == 8
    assert config.lora.targets == ("q_proj",)
    assert api.config().train.steps == 0  # the defaults


def test_config_from_a_workdir_and_its_file(tmp_path):
    config = api.config(overrides={"lora.rank": 4, "model.path": "m"})
    check_config(frozen(config), tmp_path, resuming=False)
    assert api.config(tmp_path).lora.rank == 4
    assert api.config(tmp_path / "config.json", {"lora.rank": 2}).lora.rank == 2
    mode = api._for_mode("export", tmp_path, None)
    assert mode.mode == "export" and mode.lora.rank == 4
    with pytest.raises(ConfigProblem, match="holds no config.json: pass a config"):
        api._for_mode("export", tmp_path / "empty", None)


def test_bad_overrides_name_the_key():
    with pytest.raises(ConfigErrors) as info:
        api.config(overrides={"lora.rnak": 4, "train.steps": "ten", "model.dtype": "fp8"})
    assert info.value.errors == [
        "override 'lora.rnak' is unknown; did you mean 'lora.rank'?",
        "override 'train.steps' must be int, got str 'ten'",
        "override 'model.dtype' must be one of auto, float32, bfloat16, float16; got 'fp8'",
    ]
    assert api.config(overrides={"optim.learning_rate": 1}).optim.learning_rate == 1.0


def test_metrics_reads_the_records_in_order(tmp_path):
    lines = [
        {"step": 1, "split": "train", "loss": 0.69},
        {"step": 1, "split": "eval", "loss": 0.7},
        {"step": 2, "split": "train", "loss": 0.6},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": 3, "spl'  # cut short by a kill
    (tmp_path / "metrics.jsonl").write_text(text)
    assert list(api.metrics(tmp_path)) == lines
    assert [r["step"] for r in api.metrics(tmp_path, "train")] == [1, 2]
    assert list(api.metrics(tmp_path / "none")) == []
