"""The train, evaluate and export jobs (`mode = "train" | "evaluate" | "export"`).

A run lives in its workdir: checkpoints (orbax, resumed automatically), metrics.jsonl and
TensorBoard events, report.md with plots, and the exported HF model. SIGTERM / SIGINT save a
checkpoint and end the run cleanly; a non-finite loss stops the run (keeping the last good
checkpoint) or skips the step, by config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections

from dpojax.config import Config, frozen
from dpojax.errors import ConfigProblem, WorkdirGone
from dpojax.interrupts import StopSignals, Watchdog
from dpojax.jobs import remote
from dpojax.jobs.fingerprint import (
    check_inputs,
    check_processes_agree,
    record_input_change,
)
from dpojax.jobs.hub_push import PushError, model_card, push_to_hub
from dpojax.jobs.lock import workdir_lock
from dpojax.jobs.phases import TRAIN_PHASES, PhaseTimes
from dpojax.jobs.progress import Progress
from dpojax.jobs.report import write_report
from dpojax.jobs.trainer import Trainer
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
from dpojax.train.metrics_io import MetricsWriter
from dpojax.train.step import NonFiniteError
from dpojax.train.tracking import make_sinks, parse_report_to

log = logging.getLogger(__name__)

HANG_MESSAGE = (
    "a collective waits for a process that hung or died, or the file system is stuck "
    "(train.step_timeout_seconds)"
)
# Metrics of a training step that an evaluation does not report.
TRAIN_ONLY_METRICS = ("grad_norm", "learning_rate", "nonfinite", "pairs", "tokens_per_s")
# callback(step, total_steps, train_metrics, eval_metrics_or_None)
StepCallback = Callable[[int, int, dict[str, float], dict[str, float] | None], None]


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


class _TrainingRun:
    """The state of one `train` call between resuming and the final checkpoint."""

    def __init__(
        self, config: Config, workdir: Path, trainer: Trainer, callback: StepCallback | None
    ):
        self.config, self.workdir, self.trainer, self.callback = config, workdir, trainer, callback
        c = config.checkpoint
        self.has_eval = bool(trainer.eval_pairs)
        self.ckpt = Checkpointer(
            workdir / "checkpoints",
            max_to_keep=c.max_to_keep,
            best_metric=c.best_metric if self.has_eval else None,
            best_mode=c.best_mode,
            async_save=c.async_save,
        )
        self.batches = trainer.train_batches()
        self.part = trainer.partition.index
        self.state, self.step = trainer.state, 0
        if self.ckpt.latest_step() is not None:
            self.state, extra = self.ckpt.restore(self.state)
            allow = config.allow_input_change
            try:
                accepted = self.batches.restore(extra["data"], allow_data_change=allow)
            except ValueError as e:
                raise ValueError(
                    f"{config.data.train_path} is not the data that the run in {workdir} was "
                    f"trained on ({e}); put the original file back to resume, start afresh "
                    f"with another --workdir (or delete {workdir / 'checkpoints'}), or pass "
                    "--config.allow_input_change=True to continue on the new data"
                ) from None
            if accepted:
                record_input_change(workdir, {"data.train_path": accepted})
            self.step = int(extra["step"])
            log.info("resumed from %s at step %d", self.ckpt.directory, self.step)
        self.last_saved = self.step
        self.workdir_id = _identity(workdir)
        self.final_eval, self.eval_step = None, None
        self.last_train: dict[str, float] | None = None

    def _save(self, metrics: dict[str, float] | None, *, force: bool = False) -> None:
        if _identity(self.workdir) != self.workdir_id:  # deleted (and maybe made again) mid-run
            raise _workdir_gone(self.workdir, "it is gone")
        extra = {"step": self.step, "data": self.batches.state()}
        self.ckpt.save(self.step, self.state, extra=extra, metrics=metrics, force=force)
        self.last_saved = self.step
        remote.after_save(self.ckpt.wait)  # an object-store workdir: push it to the bucket

    def _one_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = [next(self.batches) for _ in range(self.config.train.grad_accum)]
        if log.isEnabledFor(logging.DEBUG):
            ids = [int(i) for b in batches for i in b["pair_ids"] if i >= 0]
            log.debug("step %d: data partition %d reads pairs %s", self.step + 1, self.part, ids)
        new_state, metrics = self.trainer.train_step(self.state, stack_micro_batches(batches))
        metrics = _host_metrics(metrics)
        if metrics["nonfinite"] and not self.trainer.step_cfg.skip_nonfinite:
            raise NonFiniteError(
                f"non-finite loss or gradient at step {self.step + 1} (loss {metrics['loss']}, "
                f"grad_norm {metrics['grad_norm']}); the last good checkpoint is step "
                f"{self.last_saved} in {self.ckpt.directory}; lower optim.learning_rate or set "
                "train.nonfinite=skip"
            )
        self.state, self.step = new_state, self.step + 1
        metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - t0, 1e-9)
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

    def _report(self, metrics, eval_metrics) -> None:
        if self.callback is not None:
            self.callback(self.step, self.trainer.total_steps, metrics, eval_metrics)

    def run(
        self, writer: MetricsWriter, progress: Progress, stop: StopSignals, times: PhaseTimes
    ) -> str:
        """Steps to the end (or to a stop signal); returns the run's status. The callback runs
        after every step; an exception it raises ends the run there. `times` gets the first
        step as "compile" (tracing, compiling or loading the compiled step, and the step) and
        the others as "training" (`_split_compile`)."""
        t, total = self.config.train, self.trainer.total_steps
        # Over several processes a step can wait forever for one that hung; alone it cannot.
        seconds = t.step_timeout_seconds if jax.process_count() > 1 else 0
        watchdog = Watchdog(seconds, HANG_MESSAGE, label=process_label())
        first = self.step
        with watchdog:
            while self.step < total:
                if hosts.any_process(stop.received is not None):  # all stop at one step
                    return f"stopped by {stop.received or 'a signal to another process'}"
                watchdog.kick(f"step {self.step + 1} of {total}")
                with times.phase("compile" if self.step == first else "training"):
                    metrics = self._one_step()
                if self.last_train is None:
                    self._check_best_metric(metrics)
                self.last_train = metrics
                if self.step % t.log_every == 0 or self.step == total:
                    writer.write(self.step, metrics, split="train")
                progress.update(metrics)
                eval_metrics = None
                if self.has_eval and t.eval_every and self.step % t.eval_every == 0:
                    eval_metrics, _ = self.trainer.evaluate(self.state)
                    writer.write(self.step, eval_metrics, split="eval")
                    self.final_eval, self.eval_step = eval_metrics, self.step
                periodic = self.step % self.config.checkpoint.every_steps == 0
                if (periodic or eval_metrics is not None) and self.step < total:
                    self._save(eval_metrics)  # the final save comes after the loop
                self._report(metrics, eval_metrics)
        if self.has_eval and self.eval_step != self.step:
            logged = None
            if self.last_train is None:  # a rerun of a finished run: no step taken here
                logged = hosts.broadcast_json(_logged(self.workdir, "eval", self.step))
            if logged is not None:  # its final evaluation is logged already
                self.final_eval, self.eval_step = logged, self.step
            else:
                self.final_eval, self.eval_step = self.trainer.evaluate(self.state)[0], self.step
                writer.write(self.step, self.final_eval, split="eval")
            self._report(self.last_train, self.final_eval)
        return "completed"

    def final_checkpoint(self) -> None:
        if self.last_saved != self.step:
            self._save(self.final_eval if self.eval_step == self.step else None, force=True)
        self.ckpt.wait()


def _split_compile(times: PhaseTimes, steps: int) -> None:
    """Leaves in "compile" what the first step took beyond a typical step: the first step's
    time less the mean of the others moves to "training"."""
    first = times.wall.get("compile", 0.0)
    if steps > 1 and first > 0:
        typical = times.wall.get("training", 0.0) / (steps - 1)
        times.move("compile", "training", typical / first)


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
    directory = workdir / "checkpoints"
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def _finish(config, workdir: Path, trainer: Trainer, run: _TrainingRun, summary: dict):
    """A completed run's exports, push and report; returns the push's error (the run itself
    is complete) or None."""
    is_main = jax.process_index() == 0
    push_error = None
    summary["final_eval"] = run.final_eval
    if config.export.enabled:
        trainer.export(run.state, workdir / "export")
        best = run.ckpt.best_step()
        if best is not None:
            best_state, _ = run.ckpt.restore(run.state, step=best)
            trainer.export(best_state, workdir / "export_best")
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
    stop: StopSignals | None = None,
    final_checkpoint: bool = True,
) -> dict[str, Any]:
    """Trains (resuming from the workdir's latest checkpoint) and returns the final summary.
    `final_checkpoint=False`: a run that completes saves no last checkpoint (a `loop` round,
    whose export is what the next round reads and whose checkpoints are deleted once it is
    done); a stopped run saves one all the same, to resume from.

    `callback(step, total_steps, train_metrics, eval_metrics_or_None)` runs after every step and
    after the final evaluation (e.g. progress reporting for the Customizer server); an exception
    it raises ends the run at once (saves in flight are completed, the exception propagates).
    SIGTERM / SIGINT (recorded in `stop`, by default a `StopSignals` of this call) end the run
    after the current step with a checkpoint; a resumed run whose settings differ from the
    workdir's config.json is refused (`dpojax.jobs.workdir.check_config`), as is one whose model
    or data differ from those it started with (`dpojax.jobs.fingerprint`). The workdir is locked
    for the run (`dpojax.jobs.lock`): a second run on it stops before writing anything."""
    workdir = Path(workdir)
    with workdir_lock(workdir, enabled=jax.process_index() == 0):
        try:
            return _locked_train(config, workdir, callback, stop, final_checkpoint)
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


def _locked_train(config, workdir: Path, callback, stop, final_checkpoint: bool) -> dict[str, Any]:
    is_main = jax.process_index() == 0
    began = time.perf_counter()
    with contextlib.nullcontext(stop) if stop is not None else StopSignals() as stop:
        if is_main:
            workdir.mkdir(parents=True, exist_ok=True)
            resuming = _resuming(workdir)
            check_config(config, workdir, resuming=resuming)
            check_inputs(config, workdir, resuming=resuming)
        times = PhaseTimes(TRAIN_PHASES)
        with times.phase("setup"):
            trainer = Trainer(frozen(config), workdir, train=True, times=times)
            run = _TrainingRun(trainer.config, workdir, trainer, callback)
            first_step = run.step
            if jax.process_count() > 1:  # before the first step: no run mixes two configs
                check_processes_agree(config, run.batches.content)
            writer = _metrics_writer(config, workdir, is_main, run.step)
        progress = Progress(config.train.progress and is_main, run.step, trainer.total_steps)
        try:
            start = run.step
            with times.phase("training"):
                status = run.run(writer, progress, stop, times)
            _split_compile(times, run.step - start)
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
        summary = {
            "status": status,
            "step": run.step,
            "total_steps": trainer.total_steps,
            "attention": trainer.attention,
            "final_train": run.last_train or _logged(workdir, "train", run.step),
            **peak_memory(),
            **_throughput(began, run.step - first_step, config.train.batch_size),
        }
        push_error = None
        if status == "completed":
            with times.phase("export"):
                push_error = _finish(config, workdir, trainer, run, summary)
        run.ckpt.close()
        summary["phase_seconds"], summary["phase_cpu_seconds"] = times.rounded()
    if is_main:
        atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2))
    hosts.barrier("dpojax train done")  # process 0's files are written when any process returns
    log.info("%s at step %d of %d", status, run.step, trainer.total_steps)
    if push_error is not None:
        raise push_error
    return summary


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


def _restored_state(config, trainer: Trainer, workdir: Path, *, required: bool):
    """The workdir's latest checkpoint restored into `trainer.state`; the initial state when there
    is none (an error when `required`). A checkpoint that does not fit is an error naming the
    settings of the workdir's run that `config` changes."""
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    try:
        if ckpt.latest_step() is None:
            if required:
                raise FileNotFoundError(
                    f"{workdir / 'checkpoints'}: no checkpoint to export; train first"
                )
            return trainer.state
        return ckpt.restore(trainer.state)[0]
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


def export(config: ml_collections.ConfigDict, workdir: str | Path) -> Path:
    """Exports the workdir's latest checkpoint as an HF directory in WORKDIR/export (no data is
    read)."""
    workdir = Path(workdir)
    trainer = Trainer(frozen(config), workdir, train=False, data=False)
    state = _restored_state(config, trainer, workdir, required=True)
    trainer.export(state, workdir / "export")
    hosts.barrier("dpojax export done")
    return workdir / "export"
