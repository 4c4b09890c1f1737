"""One compile per step shape in a run: the steps auto-fit compiled to check the fit are the
run's own where its batches lower to the same program (the recipe's longest rows and step
count), so the run executes them instead of compiling them again; a batch of other shapes
compiles its own step as before. Compiles are counted with JAX's monitoring events, in-process
on the tiny model."""

from __future__ import annotations

import collections

import jax
import pytest

from dpojax.config import frozen
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.jobs.train import train
from dpojax.models.tiny import make_tiny_checkpoint
from tests.helpers.repo_files import load_file

COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def long_pairs(tmp_path_factory):
    """Pairs longer than data.max_length: every batch is cut to the recipe's longest rows."""
    base = tmp_path_factory.mktemp("autofit_reuse")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    words = " ".join(f"w{i}" for i in range(60))
    pairs = [
        PreferencePair(
            prompt=f"q{i}?", chosen=f" yes {words}", rejected=f" no {words}", metadata={}
        )
        for i in range(8)
    ]
    write_pairs(pairs, base / "train.jsonl", format="trl")
    return base, model


def _config(long_pairs, **changes):
    base, model = long_pairs
    c = load_file("configs/tiny_test.py").get_config()
    c.model.path, c.data.train_path = str(model), str(base / "train.jsonl")
    c.train.batch_size, c.train.steps, c.train.eval_every = 8, 2, 0
    c.train.report_plots, c.train.auto_fit = False, "on"
    c.mesh.data, c.export.enabled = -1, False
    for key, value in changes.items():
        group, name = key.split("__")
        c[group][name] = value
    return c


class _Compiles:
    """Backend compiles (or compilation-cache loads) per jitted function, while entered."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE:
            self.counts[kwargs.get("fun_name", "?")] += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def of(self, name: str) -> int:
        return sum(n for fun, n in self.counts.items() if name in fun)


@pytest.mark.slow
def test_the_run_executes_the_train_step_auto_fit_compiled(long_pairs, tmp_path, monkeypatch):
    with _Compiles() as compiles:
        summary = train(frozen(_config(long_pairs)), tmp_path / "run")
    assert summary["status"] == "completed" and summary["auto_fit"]["changed"] == {}
    # Before: 2 (auto-fit's, then the run's own of the same program).
    assert compiles.of("train_step") == 1, compiles.counts


@pytest.mark.slow
def test_a_run_whose_rows_are_shorter_compiles_its_own_step(long_pairs, tmp_path, monkeypatch):
    with _Compiles() as compiles:
        summary = train(frozen(_config(long_pairs, data__max_length=128)), tmp_path / "run")
    assert summary["status"] == "completed"
    assert compiles.of("train_step") == 2, compiles.counts  # auto-fit's 128, the run's rows
