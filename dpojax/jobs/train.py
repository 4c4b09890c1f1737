"""The train, evaluate and export jobs (`mode = "train" | "evaluate" | "export"`).

A run lives in its workdir: checkpoints (orbax, resumed automatically), metrics.jsonl and
TensorBoard events, report.md with plots, and the exported HF model. SIGTERM / SIGINT save a
checkpoint and end the run cleanly; a non-finite loss stops the run (keeping the last good
checkpoint) or skips the step, by config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
from etils import epath

from dpojax.config import Config, frozen
from dpojax.errors import ConfigProblem, WorkdirGone
from dpojax.hardware.chips import chip_for
from dpojax.interrupts import StopSignals, Watchdog
from dpojax.jobs import remote
from dpojax.jobs.autofit import auto_fit
from dpojax.jobs.bounds import batch_problem, check_sizes
from dpojax.jobs.callbacks import Dispatcher, builtin_callbacks, check_callbacks
from dpojax.jobs.fingerprint import (
    check_inputs,
    check_processes_agree,
    record_input_change,
)
from dpojax.jobs.hub_push import PushError, model_card, push_to_hub, write_card
from dpojax.jobs.lock import workdir_lock
from dpojax.jobs.phases import TRAIN_PHASES, PhaseTimes
from dpojax.jobs.progress import Progress
from dpojax.jobs.report import write_report
from dpojax.jobs.run_identity import (
    RUN_ID,
    read_run_id,
    restore_checked,
    settle_run_id,
    start_run,
    write_run_id,
)
from dpojax.jobs.trainer import StepperCache, Trainer
from dpojax.jobs.workdir import (
    atomic_write_text,
    check_config,
    replaced_dir,
    settings_text,
    used_settings,
)
from dpojax.runtime import peak_memory, process_label
from dpojax.train import hosts
from dpojax.train.batches import stack_micro_batches
from dpojax.train.checkpoint import Checkpointer, CheckpointError
from dpojax.train.flops import batch_work, step_flops
from dpojax.train.metrics_io import MetricsWriter
from dpojax.train.prefetch import Prefetcher
from dpojax.train.profile import StepProfiler, parse_profile_steps
from dpojax.train.state import policy_model
from dpojax.train.step import NonFiniteError, nonfinite_cause
from dpojax.train.timing import RunTimer
from dpojax.train.tracking import make_sinks, parse_report_to

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


class _TrainingRun:
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
        self.workdir_id = _identity(workdir)
        self.final_eval, self.eval_step = None, None
        self.last_train: dict[str, float] | None = None
        self.pending: _Pending | None = None
        self.hooks = Dispatcher(active=False)  # the callbacks (`dpojax.jobs.callbacks`)
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
        if _identity(self.workdir) != self.workdir_id:  # deleted (and maybe made again) mid-run
            raise _workdir_gone(self.workdir, "it is gone")
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
        batches = [next(self.batches) for _ in range(self.config.train.grad_accum)]
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
                logged = hosts.broadcast_json(_logged(self.workdir, "eval", self.step))
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


def _split_compile(times: PhaseTimes, compile_seconds: float) -> None:
    """Moves the seconds JAX spent compiling the steps (its compile events, `RunTimer`) from
    "training" to "compile" (a step loaded from the compilation cache compiles nothing)."""
    training = times.wall.get("training", 0.0)
    if compile_seconds > 0 and training > 0:
        times.move("training", "compile", min(compile_seconds / training, 1.0))


def _metrics_writer(config, workdir: Path, is_main: bool, step: int) -> MetricsWriter:
    """metrics.jsonl, plus the sinks train.report_to names (TensorBoard, W&B, MLflow; process 0)."""
    sinks = []
    if is_main:
        t = config.train
        sinks = make_sinks(
            parse_report_to(t.report_to),
            workdir,
            project=t.project,
            run_name=t.run_name,
            config=config.to_dict(),
            resume_step=step,
        )
    return MetricsWriter(workdir, enabled=is_main, resume_step=step, tensorboard=False, sinks=sinks)


def _logged(workdir: Path, split: str, step: int) -> dict[str, float] | None:
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


def _resuming(workdir: Path) -> bool:
    """Whether the workdir holds a committed checkpoint to resume from."""
    directory = epath.Path(remote.checkpoint_dir(workdir))
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def _finish(config, workdir: Path, trainer: Trainer, run: _TrainingRun, summary: dict):
    """A completed run's exports, push and report; returns the push's error (the run itself
    is complete) or None."""
    is_main = jax.process_index() == 0
    push_error = None
    summary["final_eval"] = run.final_eval
    if config.export.enabled:
        trainer.export(run.state, workdir / "export")
        _write_card(config, workdir / "export", summary, len(trainer.train_pairs))
        best = run.ckpt.best_step()
        if best is not None:
            best_state, _ = run.ckpt.restore(run.state, step=best)
            trainer.export(best_state, workdir / "export_best")
            _write_card(
                config, workdir / "export_best", {**summary, "step": best}, len(trainer.train_pairs)
            )
            summary["best_step"] = best
        if config.export.push_to_hub and is_main:
            push_error = _push(config, trainer, workdir, summary)
    if is_main:
        write_report(
            workdir,
            title="dpojax training run",
            summary=summary,
            config_text=settings_text(config),
            plots=config.train.report_plots,
        )
    return push_error


def train(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    callback: StepCallback | None = None,
    callbacks: Sequence[Any] = (),
    stop: StopSignals | None = None,
    final_checkpoint: bool = True,
    fit: dict[str, Any] | None = None,
    batch_over_pairs: bool = False,
    steppers: StepperCache | None = None,
) -> dict[str, Any]:
    """Trains (resuming from the workdir's latest checkpoint) and returns the final summary.
    `final_checkpoint=False`: a run that completes saves no last checkpoint (a `loop` round,
    whose export is what the next round reads and whose checkpoints are deleted once it is
    done); a stopped run saves one all the same, to resume from. `fit`: an auto-fit decision of
    an earlier run of the same shapes (`summary["auto_fit"]`: a `loop`'s first round), taken
    instead of compiling the step again. A batch larger than the training pairs is refused
    (`dpojax.jobs.bounds`) unless `batch_over_pairs` (a loop's round: a batch is then all its
    pairs). `steppers`: where the jitted steps of an earlier job of the same settings are kept
    (a loop's rounds share one: a round compiles nothing).

    `callback(step, total_steps, train_metrics, eval_metrics_or_None)` runs after every step and
    after the final evaluation (e.g. progress reporting for the Customizer server); an exception
    it raises ends the run at once (saves in flight are completed, the exception propagates).
    `callbacks`: objects with any of the hooks of `dpojax.jobs.callbacks` (on_train_begin,
    on_step_end, on_evaluate, on_save, on_train_end; process 0), which may ask the run to stop
    (as on SIGTERM: "stopped by callback <name>") or to evaluate; the config's own
    (early stopping, the completions log) run first.
    SIGTERM / SIGINT (recorded in `stop`, by default a `StopSignals` of this call) end the run
    after the current step with a checkpoint; a resumed run whose settings differ from the
    workdir's config.json is refused (`dpojax.jobs.workdir.check_config`), as is one whose model
    or data differ from those it started with (`dpojax.jobs.fingerprint`). The workdir is locked
    for the run (`dpojax.jobs.lock`): a second run on it stops before writing anything."""
    workdir = Path(workdir)
    callbacks = list(callbacks)
    check_callbacks(callbacks)  # before anything is loaded
    with workdir_lock(workdir, enabled=jax.process_index() == 0):
        try:
            return _locked_train(
                config,
                workdir,
                (callback, callbacks),
                stop,
                final_checkpoint,
                fit,
                batch_over_pairs,
                steppers,
            )
        except Exception as e:
            if workdir.is_dir() or isinstance(e, WorkdirGone):
                raise
            raise _workdir_gone(workdir, type(e).__name__) from e


def _identity(workdir: Path) -> tuple[int, int] | None:
    """The workdir's (device, inode), or None when it does not exist."""
    try:
        st = os.stat(workdir)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _workdir_gone(workdir: Path, why: str) -> WorkdirGone:
    return WorkdirGone(
        f"cannot write {workdir}: the workdir was deleted during the run, its checkpoints with it "
        f"({why}); rerun to start afresh, or restore the folder and rerun to resume"
    )


def _locked_train(
    config,
    workdir: Path,
    callers,
    stop,
    final_checkpoint: bool,
    known_fit,
    batch_over_pairs,
    steppers: StepperCache | None,
) -> dict[str, Any]:
    """`callers`: train's (callback, callbacks)."""
    callback, callbacks = callers
    is_main = jax.process_index() == 0
    began = time.perf_counter()
    with contextlib.nullcontext(stop) if stop is not None else StopSignals() as stop:
        if is_main:
            workdir.mkdir(parents=True, exist_ok=True)
            resuming = _resuming(workdir)
            check_config(config, workdir, resuming=resuming)
            check_inputs(config, workdir, resuming=resuming)
            run_id = start_run(workdir, resuming=resuming)
        run_id = hosts.broadcast_json(run_id if is_main else None)
        times = PhaseTimes(TRAIN_PHASES)
        # Until the first step nothing is kept that a stop would lose: alone, a signal ends the
        # set-up at once (the auto-fit compiles, loading, tokenizing) instead of after it. Over
        # several processes it is recorded, and all stop together before the first step.
        alone = jax.process_count() == 1
        with stop.interruptible() if alone else contextlib.nullcontext():
            check_sizes(config)  # before anything is allocated for the recipe's sizes
            # Before the model is loaded or a pair tokenized: the step must fit the devices.
            programs: dict[str, Any] = {}  # auto-fit's compiled steps, for the run to reuse
            config, fit = auto_fit(
                config, workdir, resuming=_resuming(workdir), known=known_fit, programs=programs
            )
            with times.phase("setup"):
                trainer = Trainer(
                    frozen(config), workdir, train=True, times=times, steppers=steppers
                )
                trainer.stepper.adopt(programs)
                _check_batch(config, trainer, batch_over_pairs)
                run = _TrainingRun(trainer.config, workdir, trainer, callback, run_id)
                first_step = run.step
                if not alone:  # before the first step: no run mixes two configs
                    check_processes_agree(config, run.batches.content)
                writer = _metrics_writer(config, workdir, is_main, run.step)
                run.hooks = _dispatcher(trainer, run, writer, callbacks)
        progress = Progress(config.train.progress and is_main, run.step, trainer.total_steps)
        try:
            with times.phase("training"):
                status = run.run(writer, progress, stop)
            _split_compile(times, run.timer.compile)
            with times.phase("checkpoint"):
                if final_checkpoint or status != "completed":
                    run.final_checkpoint()
        except BaseException:
            progress.close()
            # Alone, a save in flight completes (the last checkpoint stays whole anyway). Over
            # several processes it cannot when the error is a lost process (its commit waits for
            # every process), so it is left: the last committed checkpoint is whole.
            if jax.process_count() == 1:
                with contextlib.suppress(Exception):
                    run.ckpt.close()
            with contextlib.suppress(Exception):  # the first error is the one to report
                writer.close()
            raise
        progress.close()
        writer.close()
        summary = _summary(workdir, run, status, fit)
        summary.update(_throughput(began, run.step - first_step, config.train.batch_size))
        push_error = None
        if status == "completed":
            with times.phase("export"):
                push_error = _finish(config, workdir, trainer, run, summary)
        run.ckpt.close()
        summary["phase_seconds"], summary["phase_cpu_seconds"] = times.rounded()
    if is_main:
        atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2))
    run.hooks.call("on_train_end", summary)
    hosts.barrier("dpojax train done")  # process 0's files are written when any process returns
    log.info("%s at step %d of %d", status, run.step, trainer.total_steps)
    if push_error is not None:
        raise push_error
    return summary


def _summary(workdir: Path, run: _TrainingRun, status: str, fit) -> dict[str, Any]:
    """summary.json's record of the run (its throughput and phases are added by the caller)."""
    summary = {
        "status": status,
        "step": run.step,
        "total_steps": run.trainer.total_steps,
        "attention": run.trainer.attention,
        "final_train": run.last_train or _logged(workdir, "train", run.step),
        **peak_memory(),
        "timing": run.timer.summary(),
    }
    if fit is not None:
        summary["auto_fit"] = fit
    if run.finished_early is not None:
        summary[FINISHED_EARLY] = run.finished_early
    return summary


def _dispatcher(trainer: Trainer, run: _TrainingRun, writer, callbacks) -> Dispatcher:
    """The run's callbacks: the config's own, then the caller's."""

    def policy():
        return policy_model(trainer.graphdef, run.state, trainer.is_lora)

    config = trainer.config
    return Dispatcher(
        [*builtin_callbacks(config, trainer, policy, writer, run.workdir), *callbacks]
    )


def _check_batch(config, trainer: Trainer, batch_over_pairs: bool) -> None:
    """A batch larger than the training pairs is refused, unless `batch_over_pairs` (a loop's
    rounds, whose pair counts vary: a batch is then all of them)."""
    problem = batch_problem(
        config.train.batch_size, len(trainer.train_pairs), config.data.train_path
    )
    if problem is not None and not batch_over_pairs:
        raise problem


def _throughput(began: float, steps: int, batch_size: int) -> dict[str, float | int]:
    """summary.json's runtime and throughput of one `train` call: its wall seconds up to the
    last checkpoint (loading, tokenizing and compiling included) and the optimizer steps and
    pairs per second over them (a resumed run counts the steps it took itself)."""
    seconds = max(time.perf_counter() - began, 1e-9)
    return {
        "runtime_seconds": round(seconds, 3),
        "steps_this_run": steps,
        "steps_per_second": round(steps / seconds, 4),
        "pairs_per_second": round(steps * batch_size / seconds, 3),
    }


def _write_card(config, directory: Path, summary: dict, pairs: int | None) -> None:
    """The model card (README.md) of an export, pushed or not (process 0); `from_pretrained`
    of the folder is its usage line, the workdir's name its title."""
    if jax.process_index() == 0:
        title = directory.resolve().parent.name
        write_card(
            directory,
            model_card(config, summary, pairs=pairs, repo_id=str(directory), title=title),
        )


def _push(config, trainer: Trainer, workdir: Path, summary: dict) -> PushError | None:
    """Uploads WORKDIR/export with a model card (export.push_to_hub); the outcome goes into
    `summary`, and a failure is returned to be raised once the run's files are written."""
    repo = config.export.push_to_hub
    card = model_card(config, summary, pairs=len(trainer.train_pairs), repo_id=repo)
    try:
        summary["push_to_hub"] = push_to_hub(
            workdir / "export", repo, card=card, private=config.export.private
        )
    except PushError as e:
        summary["push_to_hub"] = {"repo": repo, "error": str(e)}
        return e
    return None


def _export_summary(workdir: Path, state) -> dict:
    """What the card of an export job says of the run: the step exported and the training run's
    final evaluation where WORKDIR/summary.json has one for that step."""
    step = int(jax.device_get(state.step))
    path = workdir / "summary.json"
    run = json.loads(path.read_text()) if path.is_file() else {}
    return {"step": step, "final_eval": run.get("final_eval") if run.get("step") == step else None}


def _restored_state(
    config, trainer: Trainer, workdir: Path, *, required: bool, step: int | None = None
):
    """The workdir's latest checkpoint (or checkpoint `step`) restored into `trainer.state`; the
    initial state when there is none (an error when `required`). A checkpoint that does not fit
    is an error naming the settings of the workdir's run that `config` changes."""
    ckpt = Checkpointer(remote.checkpoint_dir(workdir), async_save=False)
    try:
        if ckpt.latest_step() is None:
            if required:
                raise FileNotFoundError(f"{ckpt.directory}: no checkpoint to export; train first")
            return trainer.state
        recorded = hosts.broadcast_json(read_run_id(workdir) if jax.process_index() == 0 else None)
        return restore_checked(
            ckpt,
            trainer.state,
            on_corrupt=config.checkpoint.on_corrupt,
            recorded=recorded,
            workdir=workdir,
            step=step,
        )[0]
    except CheckpointError as e:
        hint = used_settings(config, workdir)
        if hint is None:
            raise
        raise CheckpointError(f"{e}; {hint}") from None
    finally:
        ckpt.close()


def evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, float]:
    """Per-pair log-probs and losses of the policy (the workdir's latest checkpoint if any, else
    model.path) on data.eval_path (or data.train_path)."""
    workdir = Path(workdir)
    check_sizes(config)
    trainer = Trainer(frozen(config), workdir, train=False)
    metrics, rows = trainer.evaluate(_restored_state(config, trainer, workdir, required=False))
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        with replaced_dir(workdir / "evaluate") as out:  # whole or not at all
            out.mkdir(parents=True)
            with open(out / "pairs.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    hosts.barrier("dpojax evaluate done")
    return metrics


def export_dir(workdir: Path, step: int) -> Path:
    """Where mode=export writes: WORKDIR/export for the latest checkpoint (step 0),
    WORKDIR/export_step_<step> for an earlier one (the run's own export stays)."""
    return workdir / (f"export_step_{step}" if step else "export")


def export(config: ml_collections.ConfigDict, workdir: str | Path) -> Path:
    """Exports the workdir's latest checkpoint (or checkpoint `export.step`) as an HF directory
    in WORKDIR/export (WORKDIR/export_step_<step>); no data is read."""
    workdir = Path(workdir)
    check_sizes(config)
    trainer = Trainer(frozen(config), workdir, train=False, data=False)
    step = int(config.export.step)
    state = _restored_state(config, trainer, workdir, required=True, step=step or None)
    target = export_dir(workdir, step)
    trainer.export(state, target)
    _write_card(config, target, _export_summary(workdir, state), None)
    hosts.barrier("dpojax export done")
    return target
