"""scripts/bench/dpojax_worker.py's `device_seconds`: a figure per step, not the timed steps' total.
A fake stepper whose step takes a known time stands in for the compiled step, so the check does not
depend on the host's load (the end-to-end run in tests/e2e/test_bench_step.py times two passes of a
real step, which noise can put in either order)."""

from __future__ import annotations

import importlib
import time

import numpy as np
import pytest

from tests.helpers.repo_files import REPO_ROOT

STEP_S = 0.04


class _SleepingStepper:
    """`put` and `train_placed` as `Stepper` offers them; each step sleeps STEP_S and counts."""

    def put(self, batch, micro_axis):
        assert micro_axis
        return (batch,)

    def train_placed(self, state, arrays):
        assert arrays["pair_mask"].shape == (1, 2)  # stacked: one micro-batch of the step's pairs
        time.sleep(STEP_S)
        return state + 1, {"loss": np.float32(0.0)}


class _Batches:
    def batch(self, epoch, step):
        tokens = np.full((4, 8), step, np.int32)  # 2 pairs' rows of 8 tokens
        return {"tokens": tokens, "pair_mask": np.ones(2, np.float32)}


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    module = importlib.import_module("bench.dpojax_worker")
    monkeypatch.setattr(module.StepRunner, "batch", lambda self, step: self.batches.batch(0, step))
    return module


def test_device_seconds_is_per_step_and_runs_one_untimed_step_first(worker):
    run = worker.StepRunner(_SleepingStepper(), _Batches(), pairs_per_step=2, reference=None)
    steps = 4
    state, per_step = worker.device_seconds(run, 0, warmup=1, steps=steps)
    assert state == steps + 1  # the untimed first step (it compiles a real step) and the timed ones
    # every timed step sleeps STEP_S: a total over the steps would be at least steps x STEP_S
    assert STEP_S <= per_step < 2 * STEP_S, per_step
