"""Sizes are bounded before any allocation (issue 50, defect 7): rows against the model's positions,
a LoRA rank against its width, a batch against the host's memory and against the pairs there
are; and a stop signal ends a training run's set-up at once."""

from __future__ import annotations

import json
import signal
import time

import pytest

from dpojax.config import default_config, frozen
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.errors import ConfigErrors, ConfigProblem
from dpojax.interrupts import Interrupted
from dpojax.jobs import train
from dpojax.jobs.train import bounds
from dpojax.models.model_config import config_to_hf
from dpojax.models.tiny import make_tiny_checkpoint, tiny_config


def _config(model: str = "/models/tiny", **changes):
    config = default_config()
    config.model.path = model
    config.data.max_length = 64
    for key, value in changes.items():
        group, name = key.split("__")
        config[group][name] = value
    return config


def _sizes(config, host_bytes=None):
    return bounds.size_problems(config, positions=2048, width=64, host_bytes=host_bytes)


def test_a_recipe_within_its_model_and_host_passes():
    assert _sizes(_config(lora__rank=64, data__max_length=2048), host_bytes=2**30) == []


def test_rows_longer_than_the_positions_are_refused():
    """Before: data.max_length=10000000 was accepted and auto-fit built rows of that length."""
    (line,) = _sizes(_config(data__max_length=10_000_000))
    assert line.startswith("config key 'data.max_length' (10000000) is longer than the 2048")
    assert "max_position_embeddings" in line and "at most 2048" in line


def test_a_lora_rank_wider_than_the_model_is_refused():
    """Before: lora.rank=100000 on a 64-wide model was accepted."""
    (line,) = _sizes(_config(lora__rank=100_000))
    assert line.startswith("config key 'lora.rank' (100000) is larger than the width")
    assert "hidden_size 64" in line and "at most 64" in line


def test_a_batch_beyond_the_hosts_memory_is_refused():
    """Before: train.batch_size=1000000000 grew the host's memory to 7-9.5 GB in auto-fit."""
    lines = _sizes(_config(train__batch_size=10**9), host_bytes=16 * 2**30)
    (line,) = lines
    assert line.startswith("config key 'train.batch_size' (1000000000 pairs of up to 64 tokens")
    assert "16.0 GiB available" in line and "lower train.batch_size" in line
    (line,) = _sizes(_config(train__eval_batch_size=10**9), host_bytes=16 * 2**30)
    assert line.startswith("config key 'train.eval_batch_size' (1000000000 pairs")
    assert _sizes(_config(train__batch_size=10**9), host_bytes=None) == []  # not known


def test_check_sizes_reads_the_models_config_json(assets, tmp_path):
    _, model = assets
    fields = json.loads((model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "max_position_embeddings": 128}))
    bounds.check_sizes(_config(str(tmp_path)))
    with pytest.raises(ConfigErrors) as info:
        bounds.check_sizes(_config(str(tmp_path), data__max_length=256, lora__rank=65))
    assert [e.split(" (")[0] for e in info.value.errors] == [
        "config key 'data.max_length'",
        "config key 'lora.rank'",
    ]
    assert str(tmp_path) in info.value.errors[0]


def test_mode_plan_bounds_the_sizes_of_its_planned_model_before_building_a_batch(
    assets, tmp_path, monkeypatch
):
    """Before: mode=plan had no bound; it built the recipe's batch on the host (`host_batch`)
    whatever train.batch_size said. Its model is plan.model_config (a config.json) or model.path."""
    from dpojax.jobs import plan

    _, model = assets
    fields = json.loads((model / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "max_position_embeddings": 128}))
    monkeypatch.setattr(plan, "resolve_target", lambda _: pytest.fail("sizes come first"))
    config = _config(str(model), data__max_length=256, train__batch_size=10**9)
    config.plan.model_config = str(tmp_path / "config.json")
    with pytest.raises(ConfigErrors) as info:
        plan.plan(frozen(config), tmp_path / "work")
    assert [e.split(" (")[0] for e in info.value.errors] == [
        "config key 'data.max_length'",
        "config key 'train.batch_size'",
    ]
    assert str(tmp_path) in info.value.errors[0]
    assert not (tmp_path / "work").exists()


def test_a_batch_larger_than_the_pairs_names_the_key_the_count_and_the_fix():
    assert bounds.batch_problem(24, 24, "t.jsonl") is None
    problem = bounds.batch_problem(1000, 24, "t.jsonl")
    assert isinstance(problem, ConfigProblem)
    assert str(problem).startswith(
        "config key 'train.batch_size' (1000) is larger than the 24 training pairs of t.jsonl"
    )
    assert "--config.train.batch_size to at most 24" in str(problem)


@pytest.fixture
def assets(tmp_path):
    """A model folder with its config.json alone (what the checks before loading read), and 6
    training pairs."""
    base = tmp_path / "assets"
    model = base / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(config_to_hf(tiny_config("llama"))))
    pairs = [
        PreferencePair(prompt=f"q{i}?", chosen=f" yes {i}", rejected=f" no {i}", metadata={})
        for i in range(6)
    ]
    write_pairs(pairs, base / "train.jsonl", format="trl")
    return base, model


def _train_config(assets):
    base, model = assets
    config = _config(str(model), train__steps=2)
    config.data.train_path = str(base / "train.jsonl")
    config.train.auto_fit = "off"
    config.train.progress = False
    config.train.report_to = "none"
    return config


def test_a_signal_ends_the_set_up_at_once(assets, tmp_path, monkeypatch):
    """Before: the train job only recorded a signal until its first step, so a long auto-fit
    (a host batch of a huge train.batch_size) went on for 20+ s after SIGTERM."""

    def slow_fit(config, *args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a host loop that takes long
            sum(range(1000))
        raise AssertionError("the set-up went on after SIGTERM")

    monkeypatch.setattr(train, "auto_fit", slow_fit)
    started = time.monotonic()
    with pytest.raises(Interrupted):
        train.train(frozen(_train_config(assets)), tmp_path / "run")
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_a_batch_larger_than_the_training_pairs_is_refused_before_the_first_step(assets, tmp_path):
    base, model = assets
    make_tiny_checkpoint(model, "llama", seed=0)
    config = _train_config(assets)
    config.train.batch_size = 8
    with pytest.raises(ConfigProblem, match=r"'train.batch_size' \(8\) is larger than the 6"):
        train.train(frozen(config), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
