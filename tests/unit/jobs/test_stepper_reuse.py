"""Train jobs run one after another with one `StepperCache` (a loop's rounds) and the same
model structure, step config, mesh, optimizer settings and step count reuse the last job's
jitted steps instead of compiling their own; anything else builds new ones, and so does a job
without the cache (nothing is kept between jobs in the module). The results are those of steps
built afresh."""

from __future__ import annotations

import pytest

from dpojax.config import frozen
from dpojax.jobs.train import train
from dpojax.jobs.train import trainer as trainer_mod
from tests.helpers.steppers import count_steppers
from tests.unit.jobs.test_train_resume import _config, assets  # noqa: F401 - the fixture


@pytest.mark.slow
def test_jobs_with_the_same_settings_share_the_jitted_steps(assets, tmp_path, monkeypatch):  # noqa: F811
    built = count_steppers(monkeypatch)
    steppers = trainer_mod.StepperCache()
    first = train(frozen(_config(assets)), tmp_path / "first", steppers=steppers)
    second = train(frozen(_config(assets)), tmp_path / "second", steppers=steppers)
    assert len(built) == 1
    fresh = train(frozen(_config(assets)), tmp_path / "fresh")  # no cache: its own steps
    assert len(built) == 2
    losses = [run["final_train"]["loss"] for run in (first, second, fresh)]
    assert losses[0] == losses[1] == losses[2]
    faster = _config(assets)
    faster.optim.learning_rate *= 2  # another optimizer: its own steps
    train(frozen(faster), tmp_path / "faster", steppers=steppers)
    longer = _config(assets, steps=3)  # another step count (the schedule's length)
    train(frozen(longer), tmp_path / "longer", steppers=steppers)
    assert len(built) == 4
    train(frozen(_config(assets, steps=3)), tmp_path / "longer_again", steppers=steppers)
    assert len(built) == 4  # the last one's steps, kept
