"""The step loop of a train job: from the resumed state to the final checkpoint.

`StepLoop` runs one step ahead of its results: step N+1 is dispatched before step N's metrics are
read, while the batches of the next `train.prefetch_steps` steps are built and put on the devices
on a background thread. Around the steps: evaluation, checkpoints (and the run record they keep),
the callbacks, the profiler, the stop signals and the watchdog. The job around it (locking, sizes,
auto-fit, exports, the report) is `dpojax.jobs.train`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from dpojax.config import Config
from dpojax.errors import ConfigProblem, WorkdirGone
from dpojax.hardware.chips import chip_for
from dpojax.interrupts import StopSignals, Watchdog
from dpojax.jobs.train.callbacks import Dispatcher
from dpojax.jobs.train.progress import Progress
from dpojax.jobs.train.trainer import Trainer
from dpojax.jobs.workdir import remote
from dpojax.jobs.workdir.fingerprint import record_input_change
from dpojax.jobs.workdir.run_identity import RUN_ID, restore_checked, settle_run_id, write_run_id
from dpojax.runtime import process_label
from dpojax.train import hosts
from dpojax.train.batches import stack_micro_batches
from dpojax.train.checkpoint import Checkpointer
from dpojax.train.flops import batch_work, step_flops
from dpojax.train.metrics_io import MetricsWriter
from dpojax.train.prefetch import Prefetcher
from dpojax.train.profile import StepProfiler, parse_profile_steps
from dpojax.train.step import NonFiniteError, nonfinite_cause
from dpojax.train.timing import RunTimer

log = logging.getLogger(__name__)

HANG_MESSAGE = (
    "a collective waits for a process that hung or died, or the file system is stuck "
    "(train.step_timeout_seconds)"
)
# Metrics of a training step that an evaluation does not report.
TRAIN_ONLY_METRICS = ("grad_norm", "learning_rate", "nonfinite", "pairs", "tokens_per_s")
# The checkpoint's (and summary's) record of a run a callback finished early (early stopping):
# {"step": N, "by": name}; a rerun on the workdir takes no further step.
FINISHED_EARLY = "finished_early"
# callback(step, total_steps, train_metrics, eval_metrics_or_None)
StepCallback = Callable[[int, int, dict[str, float], dict[str, float] | None], None]


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


@dataclasses.dataclass
class _Prepared:
    """One step's batch as the prefetch thread leaves it: on the devices (or, over several
    processes, on the host: placing it takes a collective, which stays on the step's thread),
    the data position after it, its model FLOPs and (for debugging) its pair ids."""

    arrays: dict
    data_state: dict
    flops: float
    pair_ids: list[int]


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: Any
    flops: float


class StepLoop:
    """The state of one `train` call between resuming and the final checkpoint.

    The loop runs one step ahead of its results: step N+1 is dispatched before step N's metrics
    are read (while the batches of the next `train.prefetch_steps` steps are built and put on the
    devices on a background thread). A step after which the run evaluates, saves, profiles or
    ends is read before anything uses its state, so a non-finite step is never saved."""

    def __init__(
        self,
        config: Config,
        workdir: Path,
        trainer: Trainer,
        callback: StepCallback | None,
        run_id: str | None,
    ):
        self.config, self.workdir, self.trainer, self.callback = config, workdir, trainer, callback
        c = config.checkpoint
        self.has_eval = bool(trainer.eval_pairs)
        self.ckpt = Checkpointer(
            remote.checkpoint_dir(workdir),
            max_to_keep=c.max_to_keep,
            best_metric=c.best_metric if self.has_eval else None,
            best_mode=c.best_mode,
            async_save=c.async_save,
            compress=c.compress,
        )
        self.batches = trainer.train_batches()
        self.finished_early: dict[str, Any] | None = None
        self.part = trainer.partition.index
        self.state, self.step, self.run_id = trainer.state, 0, run_id
        if self.ckpt.latest_step() is not None:
            self.state, extra = self._restore(run_id)
            allow = config.allow_input_change
            try:
                accepted = self.batches.restore(extra["data"], allow_data_change=allow)
            except ValueError as e:
                raise ValueError(
                    f"{config.data.train_path} is not the data that the run in {workdir} was "
                    f"trained on ({e}); put the original file back to resume, start afresh "
                    f"with another --workdir (or delete {self.ckpt.directory}), or pass "
                    "--config.allow_input_change=True to continue on the new data"
                ) from None
            if accepted:
                record_input_change(workdir, {"data.train_path": accepted})
            self.step = int(extra["step"])
            self.finished_early = extra.get(FINISHED_EARLY)
            log.info("resumed from %s at step %d", self.ckpt.directory, self.step)
        self.data_state = self.batches.state()  # the position after the last step taken
        self.last_saved = self.step
        self.workdir_id = workdir_identity(workdir)
        self.final_eval, self.eval_step = None, None
        self.last_train: dict[str, float] | None = None
        self.pending: _Pending | None = None
        self.hooks = Dispatcher(active=False)  # the callbacks (`dpojax.jobs.train.callbacks`)
        chip = chip_for(jax.devices()[0].device_kind)
        self.timer = RunTimer(jax.device_count(), chip.bf16_flops if chip else None)
        self.profiler = StepProfiler(
            parse_profile_steps(config.train.profile_steps), workdir / "profile"
        )

    def _restore(self, recorded: str | None) -> tuple[Any, dict[str, Any]]:
        """The latest checkpoint that verifies (`restore_checked`): corrupt later steps it went
        back from are moved aside; a workdir without a run record takes the checkpoint's run id
        (or a new one)."""
        state, extra = restore_checked(
            self.ckpt,
            self.state,
            on_corrupt=self.config.checkpoint.on_corrupt,
            recorded=recorded,
            workdir=self.workdir,
        )
        if self.ckpt.passed_over:
            self.ckpt.set_aside(self.ckpt.passed_over)
        if recorded is None:
            fresh = None if extra.get(RUN_ID) else hosts.broadcast_json(secrets.token_hex(8))
            self.run_id = settle_run_id(recorded, extra, fresh)
            if jax.process_index() == 0:
                write_run_id(self.workdir, self.run_id)
        return state, extra

    def _save(self, metrics: dict[str, float] | None, *, force: bool = False) -> None:
        if (
            workdir_identity(self.workdir) != self.workdir_id
        ):  # deleted (and maybe made again) mid-run
            raise workdir_gone(self.workdir, "it is gone")
        extra = {"step": self.step, "data": self.data_state, RUN_ID: self.run_id}
        if self.finished_early is not None:
            extra[FINISHED_EARLY] = self.finished_early
        with self.timer.phase("checkpoint"):
            saved = self.ckpt.save(self.step, self.state, extra=extra, metrics=metrics, force=force)
        self.last_saved = self.step
        remote.after_save(self.ckpt.wait)  # an object-store workdir: push it to the bucket
        if saved:
            self.hooks.call("on_save", self.step, str(self.ckpt.directory / str(self.step)))

    def _prepare(self) -> _Prepared:
        """The next step's batch (on the prefetch thread)."""
        batches = next(self.batches)  # the step's micro-batches
        data_state = self.batches.state()
        ids = [int(i) for b in batches for i in b["pair_ids"] if i >= 0]
        flops = sum(step_work_flops(self.trainer, b) for b in batches)
        host = self.trainer.with_reference(stack_micro_batches(batches), "train")
        stepper = self.trainer.stepper
        arrays = host if stepper.multi_process else stepper.put(host, micro_axis=True)[0]
        return _Prepared(arrays, data_state, flops, ids)

    def _dispatch(self, item: _Prepared) -> None:
        """Starts the next step (its results are read later, `_read`)."""
        stepper = self.trainer.stepper
        arrays = item.arrays
        if stepper.multi_process:
            arrays = stepper.put(arrays, micro_axis=True)[0]
        log.debug(
            "step %d: data partition %d reads pairs %s", self.step + 1, self.part, item.pair_ids
        )
        self.profiler.before(self.step + 1)
        self.state, metrics = stepper.train_placed(self.state, arrays)
        self.step, self.data_state = self.step + 1, item.data_state
        self.pending = _Pending(self.step, metrics, item.flops)
        self.profiler.after(self.step, self.state)

    def _read(self, pending: _Pending, writer, progress: Progress) -> dict[str, float]:
        """Reads a dispatched step's metrics (waiting for it); raises on a non-finite step."""
        if pending is self.pending:
            self.pending = None
        metrics = _host_metrics(pending.metrics)
        if metrics["nonfinite"] and not self.trainer.step_cfg.skip_nonfinite:
            raise NonFiniteError(
                f"non-finite step {pending.step}: {nonfinite_cause(pending.step, metrics)}; "
                f"the last good checkpoint is step {self.last_saved} in {self.ckpt.directory}"
            )
        seconds = self.timer.step_done(metrics["tokens"], pending.flops)
        metrics["tokens_per_s"] = metrics["tokens"] / max(seconds, 1e-9)
        total = self.trainer.total_steps
        if pending.step % self.config.train.log_every == 0 or pending.step == total:
            writer.write(pending.step, metrics, split="train")
        progress.update(metrics)
        if self.last_train is None:
            self._check_best_metric(metrics)
        self.last_train = metrics
        self.hooks.call("on_step_end", pending.step, metrics)
        return metrics

    def _check_best_metric(self, metrics: dict[str, float]) -> None:
        """At the first step: checkpoint.best_metric must be a metric the evaluation reports
        (a typo would otherwise disable the best checkpoint and export_best silently)."""
        name = self.config.checkpoint.best_metric
        if self.has_eval and (name not in metrics or name in TRAIN_ONLY_METRICS):
            names = sorted(k for k in metrics if k not in TRAIN_ONLY_METRICS)
            raise ConfigProblem(
                f"config key 'checkpoint.best_metric': {name!r} is not an evaluation metric; "
                f"choose one of {', '.join(names)}"
            )

    def _report(self, step, metrics, eval_metrics) -> None:
        if self.callback is not None:
            self.callback(step, self.trainer.total_steps, metrics, eval_metrics)

    def _synchronous(self, step: int) -> bool:
        """Whether step `step`'s results are read before the next step starts: the run
        evaluates, saves or ends after it, or the profile window ends there."""
        t, total = self.config.train, self.trainer.total_steps
        window = self.profiler.window
        return (
            step >= total
            or (self.has_eval and t.eval_every and step % t.eval_every == 0)
            or step % self.config.checkpoint.every_steps == 0
            or (window is not None and step == window[1])
            or self.hooks.evaluate
            or self.hooks.synchronous(step)
        )

    def _after_step(self, writer: MetricsWriter) -> dict[str, float] | None:
        """Evaluation and the periodic save after the step just read."""
        t, total = self.config.train, self.trainer.total_steps
        eval_metrics = None
        scheduled = t.eval_every and self.step % t.eval_every == 0
        requested = self.hooks.evaluate  # by a callback
        self.hooks.evaluated()
        if requested and not self.has_eval:
            log.warning(
                "step %d: a callback asked for an evaluation; there are no eval pairs", self.step
            )
        if self.has_eval and (scheduled or requested):
            with self.timer.phase("evaluation"):
                eval_metrics, _ = self.trainer.evaluate(self.state)
            writer.write(self.step, eval_metrics, split="eval")
            self.final_eval, self.eval_step = eval_metrics, self.step
            self.hooks.call("on_evaluate", self.step, eval_metrics)
            self.hooks.agree()  # a finish asked for here is recorded in this step's checkpoint
            self._note_finish()
        periodic = self.step % self.config.checkpoint.every_steps == 0
        if (periodic or eval_metrics is not None) and self.step < total:
            self._save(eval_metrics)  # the final save comes after the loop
        self.timer.restart_interval()
        return eval_metrics

    def _note_finish(self) -> None:
        """Records a callback's request to finish the run at the current step."""
        if self.hooks.finish_by and self.finished_early is None:
            self.finished_early = {"step": self.step, "by": self.hooks.finish_by}
            log.info("finishing at step %d, asked by callback %s", self.step, self.hooks.finish_by)

    def _loop(self, writer, progress, stop, watchdog, prefetch) -> str | None:
        total = self.trainer.total_steps
        while self.step < total:
            self.hooks.agree()  # the requests of the step read last, on every process
            if self.finished_early is not None or self.hooks.finish_by:  # ends as completed
                if self.pending is not None:
                    pending = self.pending
                    self._report(pending.step, self._read(pending, writer, progress), None)
                self._note_finish()
                return None
            signalled = hosts.any_process(stop.received is not None)
            if signalled or self.hooks.stop_by:  # all stop at one step
                if self.pending is not None:
                    pending = self.pending
                    self._report(pending.step, self._read(pending, writer, progress), None)
                if not signalled:
                    return f"stopped by callback {self.hooks.stop_by}"
                return f"stopped by {stop.received or 'a signal to another process'}"
            watchdog.kick(f"step {self.step + 1} of {total}")
            with self.timer.phase("input_wait"):
                item = prefetch.get()
            previous = self.pending
            self._dispatch(item)
            if previous is not None:  # read while the devices run the step just dispatched
                self._report(previous.step, self._read(previous, writer, progress), None)
                self.hooks.agree()  # an evaluation its hooks asked for comes after this step
            if self._synchronous(self.step):
                metrics = self._read(self.pending, writer, progress)
                eval_metrics = self._after_step(writer)
                if not (self.step >= total and self.has_eval and eval_metrics is None):
                    self._report(self.step, metrics, eval_metrics)
                # else `run` reports the last step once, with its final evaluation
        return None

    def run(self, writer: MetricsWriter, progress: Progress, stop: StopSignals) -> str:
        """Steps to the end (or to a stop signal); returns the run's status. The callback runs
        once after every step (one step late, except where the run evaluates, saves or ends; for
        the last step after the final evaluation); an exception it raises ends the run there."""
        t = self.config.train
        # Over several processes a step can wait forever for one that hung; alone it cannot.
        seconds = t.step_timeout_seconds if jax.process_count() > 1 else 0
        watchdog = Watchdog(seconds, HANG_MESSAGE, label=process_label())
        prefetch = Prefetcher(self._prepare, t.prefetch_steps)
        self.hooks.call("on_train_begin", self.step, self.trainer.total_steps)
        try:
            with watchdog, self.timer:
                stopped = self._loop(writer, progress, stop, watchdog, prefetch)
        finally:
            prefetch.close()
            self.profiler.close()
        if stopped:
            return stopped
        if self.has_eval and self.eval_step != self.step:
            logged = None
            if self.last_train is None:  # a rerun of a finished run: no step taken here
                logged = hosts.broadcast_json(logged_metrics(self.workdir, "eval", self.step))
            if logged is not None:  # its final evaluation is logged already
                self.final_eval, self.eval_step = logged, self.step
            else:
                with self.timer.phase("evaluation"):
                    self.final_eval = self.trainer.evaluate(self.state)[0]
                self.eval_step = self.step
                writer.write(self.step, self.final_eval, split="eval")
                self.hooks.call("on_evaluate", self.step, self.final_eval)
            self._report(self.step, self.last_train, self.final_eval)
        return "completed"

    def final_checkpoint(self) -> None:
        with self.timer.phase("checkpoint"):
            if self.last_saved != self.step:
                self._save(self.final_eval if self.eval_step == self.step else None, force=True)
            self.ckpt.wait()


def step_work_flops(trainer: Trainer, batch: dict) -> float:
    """dpojax's model FLOPs of one micro-batch (`dpojax.train.flops`)."""
    tokens, pairs, scored = batch_work(batch)
    return step_flops(
        trainer.policy.config,
        tokens,
        pairs,
        scored,
        reference_forward=trainer.step_cfg.reference_forward,
        lm_head_everywhere=trainer.step_cfg.nll_prompt,
    )


def logged_metrics(workdir: Path, split: str, step: int) -> dict[str, float] | None:
    """The metrics of `split` at `step` that metrics.jsonl holds (a run resumed at its end
    takes no step of its own), or None."""
    found = None
    path = workdir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("split") == split and record.get("step") == step:
                found = {k: v for k, v in record.items() if k not in ("split", "step", "time")}
    return found


def workdir_identity(workdir: Path) -> tuple[int, int] | None:
    """The workdir's (device, inode), or None when it does not exist."""
    try:
        st = os.stat(workdir)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def workdir_gone(workdir: Path, why: str) -> WorkdirGone:
    return WorkdirGone(
        f"cannot write {workdir}: the workdir was deleted during the run, its checkpoints with it "
        f"({why}); rerun to start afresh, or restore the folder and rerun to resume"
    )
