"""Callbacks of a training run (`dpojax.jobs.train.callbacks`): hooks called in order on process 0 only,
stop and evaluate requests taken once and named in the status, early stopping's counter, the
completions log; the config keys of the built-in ones need evaluation pairs. The slow tests train
the tiny model in-process: the order of the hooks over a run, a stop request that ends the run
with a checkpoint and a rerun that resumes, an evaluation on request, early stopping, and the
completions log's lines."""

from __future__ import annotations

import json
import math

import pytest

from dpojax import api
from dpojax.config import default_config, validate
from dpojax.jobs.train.callbacks import (
    EVALUATE,
    FINISH,
    STOP,
    CompletionsLogger,
    Control,
    Dispatcher,
    EarlyStopping,
    truncate_completions,
)
from tests.helpers.processes import REPO, run_processes


class Recorder:
    def __init__(self, name, seen, answers=None):
        self.name, self.seen, self.answers = name, seen, answers or {}

    def on_step_end(self, step, metrics):
        self.seen.append((self.name, "step", step))
        return self.answers.get(step)

    def on_train_end(self, summary):
        self.seen.append((self.name, "end", summary["status"]))


def test_hooks_run_in_order_and_requests_are_taken_once():
    seen = []
    hooks = Dispatcher(
        [Recorder("a", seen, {2: EVALUATE}), Recorder("b", seen, {3: STOP})], active=True
    )
    hooks.call("on_step_end", 1, {})
    hooks.call("on_evaluate", 1, {})  # neither defines it: skipped
    hooks.agree()
    assert seen == [("a", "step", 1), ("b", "step", 1)]
    assert not hooks.evaluate and hooks.stop_by is None

    hooks.call("on_step_end", 2, {})
    assert not hooks.evaluate  # until agreed: every process takes it at the same point
    hooks.agree()
    assert hooks.evaluate
    hooks.evaluated()
    hooks.agree()
    assert not hooks.evaluate  # one request, one evaluation

    hooks.call("on_step_end", 3, {})
    hooks.agree()
    assert hooks.stop_by == "b"
    hooks.call("on_train_end", {"status": "stopped by callback b"})
    assert seen[-1] == ("b", "end", "stopped by callback b")

    finishing = Dispatcher([Recorder("c", [], {4: FINISH})], active=True)
    finishing.call("on_step_end", 4, {})
    assert finishing.finish_by is None  # until agreed
    finishing.agree()
    assert finishing.finish_by == "c" and finishing.stop_by is None


def test_hooks_run_on_process_zero_only_unless_marked():
    seen = []

    class Everywhere(Recorder):
        all_processes = True

    hooks = Dispatcher([Recorder("a", seen), Everywhere("b", seen)], main=False, active=True)
    hooks.call("on_step_end", 1, {})
    assert seen == [("b", "step", 1)]


@pytest.mark.slow
@pytest.mark.exclusive  # 2 processes
def test_two_processes_take_process_zeros_requests_at_the_same_step():
    """2 JAX processes: only process 0's callback runs (process 1's own, which would stop at
    step 1, is never called), an `all_processes` callback runs on both, and both evaluate at
    step 2 and stop at step 5, naming process 0's callback."""
    results = run_processes(REPO / "tests" / "helpers" / "callback_processes.py")
    common = {"stopped_at": 5, "stop_by": "eager", "evaluated_at": [2], "everywhere_calls": 6}
    assert results[0] == {**common, "own_calls": 6}
    assert results[1] == {**common, "own_calls": 0}


def test_bad_callbacks_and_answers_are_named():
    class Typo:
        def on_step_ends(self, step, metrics):
            pass

    with pytest.raises(TypeError, match="Typo has none of the hooks"):
        Dispatcher([Typo()], active=False)

    class Chatty:
        name = "chatty"

        def on_save(self, step, path):
            return "stop"

    hooks = Dispatcher([Chatty()], active=False)
    with pytest.raises(TypeError, match=r"chatty.on_save returned 'stop'"):
        hooks.call("on_save", 2, "x")
    assert Control(should_stop=True) == STOP


def test_early_stopping_counts_evaluations_without_improvement():
    stopper = EarlyStopping("loss", "min", patience=2, threshold=0.01)
    answers = [stopper.on_evaluate(s, {"loss": v}) for s, v in enumerate([1.0, 0.9, 0.895, 0.8])]
    assert answers == [None] * 4  # 0.895: within the threshold, one wait; 0.8 resets it
    assert stopper.best == 0.8 and stopper.waited == 0
    assert stopper.on_evaluate(5, {"loss": 0.85}) is None
    assert stopper.on_evaluate(6, {"loss": math.nan}) is FINISH  # no value is no improvement

    rising = EarlyStopping("rewards/accuracies", "max", patience=1)
    assert rising.on_evaluate(1, {"rewards/accuracies": 0.5}) is None
    assert rising.on_evaluate(2, {"rewards/accuracies": 0.6}) is None
    assert rising.on_evaluate(3, {"rewards/accuracies": 0.6}) is FINISH


def test_completions_log_writes_k_lines_and_a_metric(tmp_path, monkeypatch):
    from dpojax.models import sampler
    from dpojax.models.sampler import Completion

    def generate(model, prompts, **kwargs):
        assert kwargs["temperature"] == 0.0 and kwargs["max_new_tokens"] == 5
        return [[Completion((7,) * len(p), "length", 0.0, (), text="x" * len(p))] for p in prompts]

    class Tokenizer:
        def batch_decode(self, ids, skip_special_tokens):
            return [" ".join(map(str, p)) for p in ids]

    class Writer:
        records = []

        def write(self, step, values, split):
            self.records.append((step, split, values))

    monkeypatch.setattr(sampler, "generate", generate)
    logger = CompletionsLogger(
        2, [[1, 2], [3, 4, 5]], lambda: None, Tokenizer(), Writer(), tmp_path, 5
    )
    assert [s for s in range(1, 6) if logger.synchronous(s)] == [2, 4]
    for step in range(1, 6):
        logger.on_step_end(step, {})
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"], r["completion"]) for r in rows] == [
        (2, "1 2", "xx"),
        (2, "3 4 5", "xxx"),
        (4, "1 2", "xx"),
        (4, "3 4 5", "xxx"),
    ]
    assert Writer.records == [(2, "completions", {"mean_tokens": 2.5})] * 1 + [
        (4, "completions", {"mean_tokens": 2.5})
    ]
    truncate_completions(tmp_path, 3)  # a run resumed at step 3 logs step 4 again
    assert len((tmp_path / "completions.jsonl").read_text().splitlines()) == 2


def test_the_built_in_callbacks_need_evaluation_pairs():
    config = default_config()
    config.mode = "train"
    config.model.path = "m"
    config.train.steps = 2
    config.train.early_stopping_patience = 2
    config.train.log_completions_every = 5
    errors = [e for e in validate(config) if "evaluation pairs" in e]
    assert len(errors) == 2 and "'train.early_stopping_patience' (2)" in errors[0]
    assert "'train.log_completions_every' (5)" in errors[1] and "data.eval_path" in errors[1]
    config.data.eval_path = "eval.jsonl"
    assert not [e for e in validate(config) if "evaluation pairs" in e]


def test_the_api_exports_the_callback_names():
    assert api.STOP.should_stop and api.EVALUATE.should_evaluate
    assert api.EarlyStopping("loss").patience == 1


# -- in-process training runs of the tiny model -------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dpojax.data.pair_files import write_pairs
    from dpojax.data.pairs import PreferencePair
    from dpojax.models.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("callbacks")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    pairs = [
        PreferencePair(prompt=f"q{i}?", chosen=f" yes {i}", rejected=f" no {i}", metadata={})
        for i in range(16)
    ]
    write_pairs(pairs, base / "pairs.jsonl", format="trl")
    return base, model


def _config(assets, **train):
    from tests.helpers.repo_files import load_file

    base, model = assets
    config = load_file("configs/tiny_test.py").get_config()
    config.model.path = str(model)
    config.data.train_path = config.data.eval_path = str(base / "pairs.jsonl")
    config.train.batch_size = config.train.eval_batch_size = 8  # over the 8 test devices
    config.train.report_plots = False
    config.mesh.data = -1
    config.export.enabled = False
    config.checkpoint.every_steps = 100  # saves at the evaluations and the end only
    for key, value in train.items():
        config.train[key] = value
    return config


class Hooks:
    """Records every hook; asks for an evaluation and a stop at the steps given."""

    name = "recorder"

    def __init__(self, evaluate_at=(), stop_at=()):
        self.seen, self.evaluate_at, self.stop_at = [], evaluate_at, stop_at

    def on_train_begin(self, step, total_steps):
        self.seen.append(("begin", step, total_steps))

    def on_step_end(self, step, metrics):
        assert math.isfinite(metrics["loss"])
        self.seen.append(("step", step))
        return EVALUATE if step in self.evaluate_at else STOP if step in self.stop_at else None

    def on_evaluate(self, step, metrics):
        self.seen.append(("evaluate", step))

    def on_save(self, step, path):
        assert path.endswith(f"checkpoints/{step}")
        self.seen.append(("save", step))

    def on_train_end(self, summary):
        self.seen.append(("end", summary["status"], summary["step"]))


def _checkpoints(work):
    return sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_hook_order_an_evaluation_and_a_stop_on_request_and_the_resumed_run(assets, tmp_path):
    """Steps are read one step late (step N's metrics after step N+1 started), so an evaluation
    asked for at step 1 runs after step 2, and a stop asked for at step 4 ends the run after
    step 5, with a checkpoint there; the rerun resumes at step 5 and completes."""
    work = tmp_path / "run"
    config = _config(assets, steps=6, eval_every=3)
    first = Hooks(evaluate_at=(1,), stop_at=(4,))
    summary = api.train(config, work, callbacks=[first])
    assert summary["status"] == "stopped by callback recorder" and summary["step"] == 5
    assert first.seen == [
        ("begin", 0, 6),
        ("step", 1),
        ("step", 2),
        ("evaluate", 2),  # asked for at step 1
        ("save", 2),
        ("step", 3),
        ("evaluate", 3),  # train.eval_every
        ("save", 3),
        ("step", 4),
        ("step", 5),
        ("save", 5),  # the stop's checkpoint
        ("end", "stopped by callback recorder", 5),
    ]
    assert [r["step"] for r in api.metrics(work, "eval")] == [2, 3]
    assert _checkpoints(work) == [2, 3, 5]

    again = Hooks()
    summary = api.train(config, work, callbacks=[again])
    assert summary["status"] == "completed" and summary["steps_this_run"] == 1
    assert again.seen == [
        ("begin", 5, 6),
        ("step", 6),
        ("evaluate", 6),
        ("save", 6),
        ("end", "completed", 6),
    ]


@pytest.mark.slow
def test_early_stopping_and_the_completions_log(assets, tmp_path):
    """An evaluation every step; no later one improves the loss by 100, so with patience 1 the
    run finishes after the second, at step 2 (completed, with its exports; a rerun takes no
    further step), having logged 3 prompts' completions there."""
    work = tmp_path / "run"
    config = _config(
        assets,
        steps=6,
        eval_every=1,
        early_stopping_patience=1,
        early_stopping_threshold=100.0,
        log_completions_every=2,
        log_completions_count=3,
        log_completions_max_tokens=4,
    )
    summary = api.train(config, work)
    assert summary["status"] == "completed" and summary["step"] == 2
    assert summary["finished_early"] == {"step": 2, "by": "early_stopping"}
    assert summary["final_eval"]["loss"] > 0  # the completed run's ending (exports: off here)
    rerun = api.train(config, work)
    assert rerun["status"] == "completed" and rerun["step"] == 2
    assert rerun["finished_early"] == {"step": 2, "by": "early_stopping"}
    rows = [json.loads(x) for x in (work / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 2]
    assert all(f"q{i}?" in r["prompt"] for i, r in enumerate(rows))  # the first eval pairs'
    assert all(isinstance(r["completion"], str) and 1 <= r["tokens"] <= 4 for r in rows)
    (logged,) = api.metrics(work, "completions")
    assert logged["step"] == 2 and logged["mean_tokens"] == sum(r["tokens"] for r in rows) / 3
