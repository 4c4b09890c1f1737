"""Callbacks of a training run (`dpojax.jobs.callbacks`): hooks called in order on process 0 only,
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
from dpojax.jobs.callbacks import (
    EVALUATE,
    STOP,
    CompletionsLogger,
    Control,
    Dispatcher,
    EarlyStopping,
    truncate_completions,
)


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


def test_hooks_run_on_process_zero_only_unless_marked():
    seen = []

    class Everywhere(Recorder):
        all_processes = True

    hooks = Dispatcher([Recorder("a", seen), Everywhere("b", seen)], main=False, active=True)
    hooks.call("on_step_end", 1, {})
    assert seen == [("b", "step", 1)]


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
    assert stopper.on_evaluate(6, {"loss": math.nan}) is STOP  # no value is no improvement

    rising = EarlyStopping("rewards/accuracies", "max", patience=1)
    assert rising.on_evaluate(1, {"rewards/accuracies": 0.5}) is None
    assert rising.on_evaluate(2, {"rewards/accuracies": 0.6}) is None
    assert rising.on_evaluate(3, {"rewards/accuracies": 0.6}) is STOP


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
