"""Trainer-style callbacks of a `train` run (`dpojax.api.train(..., callbacks=[...])`).

A callback is any object with some of these methods (the others are simply not called):

    on_train_begin(step, total_steps)   before the first step (`step`: where the run resumes)
    on_step_end(step, metrics)          once per step, when its training metrics are read
    on_evaluate(step, metrics)          after each evaluation (the final one included)
    on_save(step, path)                 after a checkpoint of `step` is started (`path`: its folder;
                                        with checkpoint.async_save it may still be writing)
    on_train_end(summary)               once the run's summary is complete (any status)

A hook may return a `Control` asking the run to stop (`STOP`: the run ends like on SIGTERM, with
a checkpoint, and a later `train` on the workdir resumes it; the summary's status is "stopped by
callback <name>"), to finish (`FINISH`: training ends there as a completed run, with the final
evaluation, checkpoint and exports; the summary's `finished_early` names the step and the
callback, and the checkpoint records it, so a rerun on the workdir takes no further step) or to
evaluate now (`EVALUATE`). A request is acted on at the next step
boundary: a step whose metrics a hook saw was read while the next one already ran (the loop runs
one step ahead), so that step in flight completes first; a step that evaluates, saves or ends the
run is read before the next starts, and a request made there applies to it.

Hooks run on process 0 only and never inside the compiled step; process 0's requests are shared
with the other processes (`dpojax.train.hosts`), so all stop or evaluate at the same step. A
callback with `all_processes = True` (the completions logger, whose generation is a computation
over every device) runs on every process.

Built in, enabled from the config: `EarlyStopping` (train.early_stopping_patience on
checkpoint.best_metric; it finishes the run) and `CompletionsLogger` (train.log_completions_every).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from dpojax.train import hosts
from dpojax.train.tracking import WandbSink

HOOKS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")
COMPLETIONS_FILE = "completions.jsonl"


@dataclasses.dataclass(frozen=True)
class Control:
    """What a hook asks of the run: stop (with a checkpoint, resumable), finish (end training as
    completed, with the exports) and / or evaluate now."""

    should_stop: bool = False
    should_evaluate: bool = False
    should_finish: bool = False


STOP = Control(should_stop=True)
EVALUATE = Control(should_evaluate=True)
FINISH = Control(should_finish=True)


class Callback(Protocol):
    """The hooks a callback may define (all optional; see the module docstring)."""

    def on_train_begin(self, step: int, total_steps: int) -> Control | None: ...
    def on_step_end(self, step: int, metrics: dict[str, float]) -> Control | None: ...
    def on_evaluate(self, step: int, metrics: dict[str, float]) -> Control | None: ...
    def on_save(self, step: int, path: str) -> Control | None: ...
    def on_train_end(self, summary: dict[str, Any]) -> Control | None: ...


def callback_name(callback: Any) -> str:
    """How a status names a callback: its `name` attribute, else its class's name."""
    name = getattr(callback, "name", None)
    return name if isinstance(name, str) and name else type(callback).__name__


def check_callbacks(callbacks: Sequence[Any]) -> None:
    """Refuses an object with none of the hooks (a typo such as `on_step_ends`), or a hook that
    is not callable, naming it."""
    for callback in callbacks:
        found = [h for h in HOOKS if getattr(callback, h, None) is not None]
        if not found:
            raise TypeError(
                f"callback {callback_name(callback)} has none of the hooks {', '.join(HOOKS)}"
            )
        for hook in found:
            if not callable(getattr(callback, hook)):
                raise TypeError(f"callback {callback_name(callback)}: {hook} is not callable")


class Dispatcher:
    """Calls the callbacks' hooks in order and keeps their requests until the run takes them.

    `main`: whether this is process 0 (default: `jax.process_index() == 0`); elsewhere only the
    callbacks marked `all_processes` run. `agree()` makes process 0's requests every process's
    (one small exchange, only when some process has callbacks: `active`, agreed here unless
    given)."""

    def __init__(
        self,
        callbacks: Sequence[Any] = (),
        *,
        main: bool | None = None,
        active: bool | None = None,
    ):
        self.callbacks = list(callbacks)
        check_callbacks(self.callbacks)
        self.main = jax.process_index() == 0 if main is None else main
        self.active = hosts.any_process(bool(self.callbacks)) if active is None else active
        self.stop_by: str | None = None  # the callback whose stop request the run took
        self.finish_by: str | None = None  # the callback whose finish request the run took
        self.evaluate = False  # an evaluation was requested (agreed)
        self._stop_by: str | None = None  # requests made here, not yet agreed
        self._finish_by: str | None = None
        self._evaluate = False

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None or not (self.main or getattr(callback, "all_processes", False)):
                continue
            self._take(callback, hook, method(*args))

    def _take(self, callback: Any, hook: str, request: Any) -> None:
        if request is None:
            return
        if not isinstance(request, Control):
            raise TypeError(
                f"callback {callback_name(callback)}.{hook} returned {request!r}; a hook returns "
                "None or a dpojax.api.Control (api.STOP, api.EVALUATE)"
            )
        if request.should_stop and self._stop_by is None:
            self._stop_by = callback_name(callback)
        if request.should_finish and self._finish_by is None:
            self._finish_by = callback_name(callback)
        self._evaluate = self._evaluate or request.should_evaluate

    def agree(self) -> None:
        """Takes the requests made so far, as process 0 made them, on every process."""
        if not self.active:
            return
        mine = [self._stop_by, self._finish_by, self._evaluate] if self.main else None
        stop_by, finish_by, evaluate = hosts.broadcast_json(mine)
        self._stop_by, self._finish_by, self._evaluate = None, None, False
        self.stop_by = self.stop_by or stop_by
        self.finish_by = self.finish_by or finish_by
        self.evaluate = self.evaluate or bool(evaluate)

    def evaluated(self) -> None:
        """An evaluation ran: a request for one is met."""
        self.evaluate = False

    def synchronous(self, step: int) -> bool:
        """Whether a callback needs the run's state at `step` (its metrics read before the next
        step starts): one with `synchronous(step)` true."""
        return any(
            getattr(c, "synchronous", None) is not None and c.synchronous(step)
            for c in self.callbacks
        )


class EarlyStopping:
    """Finishes the run once `patience` evaluations in a row did not improve `metric` (mode "min"
    or "max") by more than `threshold` on the best value so far (as transformers'
    EarlyStoppingCallback counts): training ends there as a completed run, with its exports
    (export_best: the best checkpoint by checkpoint.best_metric)."""

    name = "early_stopping"

    def __init__(self, metric: str, mode: str = "min", patience: int = 1, threshold: float = 0.0):
        if patience < 1 or mode not in ("min", "max"):
            raise ValueError(f"early stopping needs patience >= 1 and mode min/max: {patience=}")
        self.metric, self.mode, self.patience, self.threshold = metric, mode, patience, threshold
        self.best: float | None = None
        self.waited = 0  # evaluations since the last improvement

    def improves(self, value: float) -> bool:
        if self.best is None:
            return True
        gain = self.best - value if self.mode == "min" else value - self.best
        return gain > self.threshold

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> Control | None:
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            self.waited += 1  # no usable value is no improvement
        elif self.improves(value):
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        return FINISH if self.waited >= self.patience else None


@dataclasses.dataclass
class CompletionsLogger:
    """Every `every` steps, greedy completions (at most `max_tokens` tokens) of the first `count`
    evaluation prompts by the current policy: one line per prompt in WORKDIR/completions.jsonl
    (step, prompt, completion, tokens) and their mean length as metric `completions/mean_tokens`
    (metrics.jsonl and the trackers; a W&B run also gets a table). The generation runs on every
    process (the policy is sharded over all devices); process 0 writes."""

    every: int
    prompts: list[list[int]]  # token ids
    policy: Callable[[], Any]  # the current policy model
    tokenizer: Any
    writer: Any  # the run's MetricsWriter
    workdir: Path
    max_tokens: int = 32
    main: bool = True
    name = "completions_logger"
    all_processes = True

    def synchronous(self, step: int) -> bool:
        return step % self.every == 0

    def on_train_begin(self, step: int, total_steps: int) -> None:
        if self.main:  # a resumed run logs the steps after its checkpoint again
            truncate_completions(self.workdir, step)

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every or not self.prompts:
            return
        from dpojax.models.sampler import generate

        results = generate(
            self.policy(),
            self.prompts,
            n=1,
            max_new_tokens=self.max_tokens,
            temperature=0.0,
            tokenizer=self.tokenizer,
        )
        if not self.main:
            return
        texts = self.tokenizer.batch_decode(self.prompts, skip_special_tokens=False)
        rows = [
            {"step": step, "prompt": text, "completion": cs[0].text, "tokens": len(cs[0].tokens)}
            for text, cs in zip(texts, results, strict=True)
        ]
        with open(self.workdir / COMPLETIONS_FILE, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        mean = sum(r["tokens"] for r in rows) / len(rows)
        self.writer.write(step, {"mean_tokens": mean}, split="completions")
        _wandb_table(self.writer, step, rows)


def _wandb_table(writer: Any, step: int, rows: list[dict[str, Any]]) -> None:
    """The round as a W&B table, on a run that reports to W&B."""
    for sink in getattr(writer, "sinks", ()):
        if not isinstance(sink, WandbSink):
            continue
        import wandb

        columns = ["step", "prompt", "completion", "tokens"]
        table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        sink.run.log({"completions/samples": table}, step=step)


def truncate_completions(workdir: Path, step: int) -> None:
    """Drops the lines of steps after `step` from WORKDIR/completions.jsonl (a resumed run logs
    them again), as metrics.jsonl's are."""
    path = workdir / COMPLETIONS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    path.write_text("".join(kept))


def builtin_callbacks(config, trainer, policy: Callable[[], Any], writer, workdir: Path) -> list:
    """The callbacks the config enables (train.early_stopping_patience,
    train.log_completions_every); they need evaluation pairs (`dpojax.config.checks`)."""
    t, c = config.train, config.checkpoint
    out: list[Any] = []
    if not trainer.eval_pairs:
        return out
    if t.early_stopping_patience > 0:
        out.append(
            EarlyStopping(
                c.best_metric, c.best_mode, t.early_stopping_patience, t.early_stopping_threshold
            )
        )
    if t.log_completions_every > 0:
        main = jax.process_index() == 0
        prompts = [[int(i) for i in p.prompt_ids] for p in trainer.eval_pairs]
        out.append(
            CompletionsLogger(
                every=t.log_completions_every,
                prompts=prompts[: t.log_completions_count],
                policy=policy,
                tokenizer=trainer.tokenizer,
                writer=writer,
                workdir=workdir,
                max_tokens=t.log_completions_max_tokens,
                main=main,
            )
        )
    return out
