"""Train-mode resume keeps the run's original config.json and refuses changed settings (naming
the keys) unless `allow_config_change=True`; a changed data file is refused naming the file, the
workdir and the fix; the progress callback runs every step and an exception it raises ends the
run cleanly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from dpojax.config import frozen
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.jobs.train import train
from dpojax.jobs.workdir import ConfigChanged
from dpojax.models.tiny import make_tiny_checkpoint
from tests.helpers.repo_files import load_file


def _recipe():
    return load_file("configs/tiny_test.py").get_config()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_resume")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    pairs = [
        PreferencePair(prompt=f"q{i}?", chosen=f" yes {i}", rejected=f" no {i}", metadata={})
        for i in range(16)
    ]
    write_pairs(pairs, base / "train.jsonl", format="trl")
    return base, model


def _config(assets, **train):
    base, model = assets
    config = _recipe()
    config.model.path = str(model)
    config.data.train_path = str(base / "train.jsonl")
    config.train.batch_size = 8  # over the 8 test devices
    config.train.eval_every = 0
    config.train.steps = 2
    config.train.report_plots = False
    config.mesh.data = -1
    config.export.enabled = False
    for key, value in train.items():
        config.train[key] = value
    return config


def _snapshot(work: Path) -> dict[str, str]:
    return {
        str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(work.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_changed_settings_are_refused_or_need_the_override(assets, tmp_path):
    work = tmp_path / "run"
    first = _config(assets)
    train(frozen(first), work)
    original = (work / "config.json").read_text()
    before = _snapshot(work)

    changed = _config(assets, steps=3)
    changed.optim.learning_rate = 5e-3
    changed.loss.beta = 0.3
    with pytest.raises(ConfigChanged) as info:
        train(frozen(changed), work)
    message = str(info.value)
    for text in ("optim.learning_rate (0.001 -> 0.005)", "loss.beta", "train.steps (2 -> 3)"):
        assert text in message, message
    assert str(work) in message and "allow_config_change" in message
    assert _snapshot(work) == before  # nothing written, config.json kept

    changed.allow_config_change = True
    summary = train(frozen(changed), work)
    assert summary["status"] == "completed" and summary["step"] == 3
    assert (work / "config.json").read_text() == original  # the run's original settings
    (line,) = (work / "config_changes.jsonl").read_text().splitlines()
    assert set(json.loads(line)["changes"]) == {"optim.learning_rate", "loss.beta", "train.steps"}
    # Keys that change how a run is watched, not what it computes, need no override.
    again = _config(assets, steps=3, progress=True, report_plots=True)
    again.optim.learning_rate, again.loss.beta = 5e-3, 0.3
    again.compilation_cache_dir = "jax_cache"
    assert train(frozen(again), work)["status"] == "completed"


@pytest.mark.slow
def test_callback_every_step_its_exception_ends_the_run_and_changed_data_is_named(assets, tmp_path):
    """Before: the callback ran once, after the final evaluation, and only with eval data; a
    changed data file was refused without naming the file, the workdir or the fix."""
    base, _ = assets
    data = tmp_path / "pairs.jsonl"
    data.write_bytes((base / "train.jsonl").read_bytes())
    config = _config(assets, steps=5)
    config.data.train_path = str(data)
    config.checkpoint.every_steps = 2
    work = tmp_path / "run"
    seen = []

    class Cancelled(Exception):
        pass

    def callback(step, total, metrics, eval_metrics):
        seen.append((step, total, bool(np.isfinite(metrics["loss"]))))
        if step == 3:
            raise Cancelled

    with pytest.raises(Cancelled):
        train(frozen(config), work, callback=callback)
    assert seen == [(1, 5, True), (2, 5, True), (3, 5, True)]
    checkpoints = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == [2]  # the save in flight completed; nothing half-written

    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:-1]) + "\n")  # one pair fewer
    with pytest.raises(ValueError) as info:
        train(frozen(config), work)
    message = str(info.value)
    assert str(data) in message and str(work) in message
    assert "put the original file back" in message and "another --workdir" in message

    # Chosen and rejected swapped in one line: the same pairs and token counts, other labels.
    # Before: the rerun resumed and finished on two datasets.
    first = json.loads(lines[0])
    first["chosen"], first["rejected"] = first["rejected"], first["chosen"]
    data.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="content: saved") as info:
        train(frozen(config), work)
    assert "allow_input_change" in str(info.value)

    data.write_text("\n".join(lines) + "\n")
    seen.clear()
    summary = train(frozen(config), work, callback=lambda *a: seen.append(a[0]))
    assert summary["status"] == "completed" and seen == [3, 4, 5]  # resumed from step 2
    assert summary["steps_this_run"] == 3 and summary["runtime_seconds"] > 0
    per_step = summary["runtime_seconds"] / 3
    assert summary["steps_per_second"] == pytest.approx(1 / per_step, rel=1e-2)
    assert summary["pairs_per_second"] == pytest.approx(
        config.train.batch_size / per_step, rel=1e-2
    )


@pytest.mark.slow
def test_the_callback_runs_once_per_step_when_the_last_step_is_no_eval_step(assets, tmp_path):
    """Before: the last step was reported twice, without and then with its final evaluation,
    when the run does not evaluate at that step (eval_every=2, steps=3)."""
    base, _ = assets
    config = _config(assets, steps=3, eval_every=2, eval_batch_size=8)  # over the 8 devices
    config.data.eval_path = str(base / "train.jsonl")
    seen = []
    summary = train(
        frozen(config), tmp_path / "run", callback=lambda s, t, m, e: seen.append((s, e))
    )
    assert summary["status"] == "completed"
    assert [step for step, _ in seen] == [1, 2, 3]
    assert [e is not None for _, e in seen] == [False, True, True]  # step 3: the final eval


@pytest.mark.slow
def test_a_best_metric_typo_is_refused_at_the_first_step(assets, tmp_path):
    """Before: checkpoint.best_metric='los' silently disabled the best checkpoint and export."""
    from dpojax.errors import ConfigProblem

    base, _ = assets
    config = _config(assets)
    config.data.eval_path = str(base / "train.jsonl")
    config.checkpoint.best_metric = "los"
    with pytest.raises(ConfigProblem) as info:
        train(frozen(config), tmp_path / "run")
    message = str(info.value)
    assert "'checkpoint.best_metric': 'los' is not an evaluation metric" in message
    assert "loss" in message and "grad_norm" not in message
