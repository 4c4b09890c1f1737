"""Loop mode survives SIGTERM / SIGINT in every phase and a re-run continues it: finished rounds
are reused (no repeated collection or evaluation, no duplicate progress lines, the wall-clock
budget goes on), the result equals an uninterrupted run's, a changed recipe is refused before
anything is written, and finished rounds keep only what they need."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from dpojax.config import frozen
from dpojax.jobs import rounds
from dpojax.jobs.rounds import collection
from dpojax.jobs.workdir import ConfigChanged
from dpojax.models.safetensors_io import load_tensors
from tests.helpers.plugin_workflow import CountingWorkflow
from tests.helpers.steppers import count_steppers
from tests.unit.collect.test_workflow import _config


def _loop_config():
    config = _config()
    config.loop.rounds = 2
    config.loop.best_metric = "mean_length"
    config.loop.replay_rounds = -1
    config.train.epochs = 1
    config.train.batch_size = 8
    config.optim.learning_rate = 1e-3
    config.data.max_length = 32
    config.train.report_plots = False
    return config


class Calls:
    """Counts the workflow's collections and evaluations, and sends this process a signal at
    a chosen one (`("collect" | "evaluate" | "train_step", n, signal)`)."""

    def __init__(self, monkeypatch):
        self.counts = {"collect": 0, "evaluate": 0, "train_step": 0}
        self.fire: tuple[str, int, int] | None = None
        from dpojax.train.step import Stepper

        for cls, name, method in (
            (CountingWorkflow, "collect", "collect"),
            (CountingWorkflow, "evaluate", "evaluate"),
            (Stepper, "train_step", "train_placed"),  # the train job's step dispatch
        ):
            monkeypatch.setattr(cls, method, self._wrap(name, getattr(cls, method)))

    def _wrap(self, name, method):
        def wrapped(obj, *args, **kwargs):
            self.counts[name] += 1
            if self.fire and self.fire[:2] == (name, self.counts[name]):
                os.kill(os.getpid(), self.fire[2])
            return method(obj, *args, **kwargs)

        return wrapped

    def reset(self, fire=None):
        self.counts = dict.fromkeys(self.counts, 0)
        self.fire = fire


def _comparable(summary: dict) -> list[dict]:
    """The rounds' records less their timings, and the greedy-answer comparison (made only
    when the previous round was evaluated by the same run)."""
    drop = ("seconds", "model", "elapsed_seconds", "phase_seconds", "phase_cpu_seconds")
    drop += ("cpu_seconds", "greedy_answers")
    return [{k: v for k, v in r.items() if k not in drop} for r in summary["rounds"]]


def _same_export(a: Path, b: Path) -> None:
    x, y = load_tensors(a / "model.safetensors"), load_tensors(b / "model.safetensors")
    assert x.keys() == y.keys()
    for name in x:
        np.testing.assert_array_equal(x[name], y[name], err_msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    work = tmp_path_factory.mktemp("loop_full")
    out = rounds.loop(frozen(_loop_config()), work)
    return work, out


@pytest.mark.slow
def test_rounds_of_one_step_count_share_their_jitted_steps(tmp_path, monkeypatch):
    """With the same step count in every round (train.steps), round 2 trains with the Stepper
    round 1 built (the loop's StepperCache): it compiles no step of its own."""
    built = count_steppers(monkeypatch)
    config = _loop_config()
    config.train.steps = 2
    out = rounds.loop(frozen(config), tmp_path / "loop")
    assert [r["round"] for r in out["rounds"]][-2:] == [1, 2]
    assert len(built) == 1


@pytest.mark.slow
def test_signals_in_every_phase_then_rerun_equals_an_uninterrupted_run(
    uninterrupted, tmp_path, monkeypatch, caplog
):
    full, full_out = uninterrupted
    calls = Calls(monkeypatch)
    work = tmp_path / "loop"
    config = _loop_config()
    caplog.set_level(logging.INFO)

    # 1. SIGTERM during round 1's training (at its first step): a checkpoint, a summary, exit.
    calls.reset(("train_step", 1, signal.SIGTERM))
    out = rounds.loop(frozen(config), work)
    assert out["status"] == "stopped by SIGTERM" and out["rounds_done"] == 0
    assert json.loads((work / "summary.json").read_text())["status"] == "stopped by SIGTERM"
    assert [p.name for p in (work / "round_01" / "train" / "checkpoints").iterdir()] == ["1"]
    assert calls.counts == {"collect": 1, "evaluate": 1, "train_step": 1}
    elapsed_1 = json.loads((work / "loop_state.json").read_text())["elapsed_seconds"]

    # 2. Re-run; SIGINT during round 2's collection: round 1 resumes from its checkpoint.
    calls.reset(("collect", 1, signal.SIGINT))
    caplog.clear()
    out = rounds.loop(frozen(config), work)
    assert out["status"] == "stopped by SIGINT" and out["rounds_done"] == 1
    assert calls.counts["evaluate"] == 1  # round 1's evaluation only: the initial one is kept
    assert calls.counts["collect"] == 1  # round 2's; round 1's pairs are reused
    total = json.loads((work / "round_01" / "train" / "summary.json").read_text())["total_steps"]
    assert calls.counts["train_step"] == total - 1  # round 1 resumed after its first step
    assert "round 0 (initial, evaluated before)" in caplog.text
    assert "round 2 of 2 (" in caplog.text  # round k of n, and the time so far
    assert not (work / "round_02" / "pairs.jsonl").exists()  # the cut collection left nothing

    # 3. Re-run; SIGTERM during round 2's evaluation (after its training completed).
    calls.reset(("evaluate", 1, signal.SIGTERM))
    out = rounds.loop(frozen(config), work)
    assert out["status"] == "stopped by SIGTERM" and out["rounds_done"] == 1
    assert calls.counts["collect"] == 1  # round 2's collection, once

    # 4. The last re-run finishes: the same rounds, metrics and model as without interruptions.
    calls.reset()
    out = rounds.loop(frozen(config), work)
    assert calls.counts == {"collect": 0, "evaluate": 1, "train_step": 0}
    assert out["status"] == "completed" and out["stop_reason"] is None
    assert _comparable(out) == _comparable(full_out)
    assert out["best_round"] == full_out["best_round"]
    _same_export(work / "export", full / "export")
    for r in ("round_01", "round_02"):
        assert (work / r / "pairs.jsonl").read_bytes() == (full / r / "pairs.jsonl").read_bytes()
    progress = (work / "data_collection_progress.jsonl").read_text().splitlines()
    assert [json.loads(x)["run_id"] for x in progress] == ["round_01", "round_02"]
    assert out["wall_seconds"] > elapsed_1  # the budget's clock went on across the runs


@pytest.mark.slow
def test_a_changed_recipe_is_refused_before_anything_is_written(uninterrupted, tmp_path):
    full, _ = uninterrupted
    work = tmp_path / "copy"
    shutil.copytree(full, work)

    def snapshot():
        return {
            str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(work.rglob("*"))
            if p.is_file()
        }

    before = snapshot()
    config = _loop_config()
    config.optim.learning_rate = 2e-3
    config.loss.beta = 0.2
    with pytest.raises(ConfigChanged) as info:
        rounds.loop(frozen(config), work)
    message = str(info.value)
    assert "optim.learning_rate (0.001 -> 0.002)" in message and "loss.beta" in message
    assert str(work) in message and "another --workdir" in message
    assert "allow_config_change" in message
    assert snapshot() == before


@pytest.mark.slow
def test_a_rerun_of_a_finished_loop_repeats_nothing(uninterrupted, tmp_path, monkeypatch):
    full, full_out = uninterrupted
    work = tmp_path / "copy"
    shutil.copytree(full, work)
    calls = Calls(monkeypatch)
    config = _loop_config()
    config.loop.max_wall_seconds = 1e-3  # run control: a re-run may change it
    out = rounds.loop(frozen(config), work)
    assert calls.counts == {"collect": 0, "evaluate": 0, "train_step": 0}
    assert _comparable(out) == _comparable(full_out)
    assert len((work / "data_collection_progress.jsonl").read_text().splitlines()) == 2
    # One more round with the budget already spent: no round starts (the clock was kept).
    config.loop.rounds = 3
    out = rounds.loop(frozen(config), work)
    assert out["stop_reason"] == "max_wall_seconds" and calls.counts["collect"] == 0


@pytest.mark.slow
def test_finished_rounds_keep_what_they_need_and_report_train_loss(uninterrupted):
    full, out = uninterrupted
    summary = json.loads((full / "summary.json").read_text())
    losses = [r["train_loss"] for r in summary["rounds"][1:]]
    assert all(isinstance(x, float) and 0 < x < 1 for x in losses), losses
    best = out["best_round"]
    for r in (1, 2):
        round_dir = full / f"round_{r:02d}"
        assert (round_dir / "pairs.jsonl").is_file() and (round_dir / "events.jsonl").is_file()
        assert (round_dir / "train" / "metrics.jsonl").is_file()
        assert not (round_dir / "train" / "checkpoints").exists()
        assert not (round_dir / "train" / "token_cache").exists()
        assert not (round_dir / "train_pairs.jsonl").exists()
        kept = r in (best, 2)  # the best round and the latest (the next round starts from it)
        assert (round_dir / "train" / "export").is_dir() == kept
    report = (full / "report.md").read_text()
    assert "train_loss" in report


def test_keep_round_files_keeps_everything(tmp_path):
    from types import SimpleNamespace

    from dpojax.jobs.rounds.state import LoopState, prune_rounds

    state = LoopState(rounds=[{"round": 0}, {"round": 1}, {"round": 2}], best_round=2)
    for r in (1, 2):
        for name in ("train/checkpoints/3", "train/export", "train/token_cache"):
            (tmp_path / f"round_{r:02d}" / name).mkdir(parents=True)
        (tmp_path / f"round_{r:02d}" / "train_pairs.jsonl").write_text("")
    keep = SimpleNamespace(loop=SimpleNamespace(keep_round_files=True))
    rounds._Rounds.prune(SimpleNamespace(config=keep, state=state, workdir=tmp_path))
    assert len(list(tmp_path.rglob("*"))) == 14  # nothing pruned
    prune_rounds(tmp_path, state, {2})
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "round_01",
        "round_01/train",
        "round_02",
        "round_02/train",
        "round_02/train/export",
    ]


@pytest.mark.slow
def test_an_interrupted_collection_writes_nothing_and_a_rerun_matches(tmp_path, monkeypatch):
    config = _loop_config()
    reference = collection.collect(frozen(config), tmp_path / "reference")
    calls = Calls(monkeypatch)
    calls.reset(("collect", 1, signal.SIGTERM))
    out = collection.collect(frozen(config), tmp_path / "run")
    assert out == {"status": "stopped by SIGTERM"}
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_file()) == ["summary.json"]
    calls.reset()
    assert (
        collection.collect(frozen(config), tmp_path / "run")["num_pairs"] == reference["num_pairs"]
    )
    for name in ("events.jsonl", "pairs.jsonl"):
        a, b = (tmp_path / d / name for d in ("reference", "run"))
        assert a.read_bytes() == b.read_bytes()
