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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from etils import epath

from dpojax import schema
from dpojax.config import Config
from dpojax.errors import WorkdirGone
from dpojax.interrupts import StopSignals
from dpojax.jobs.phases import TRAIN_PHASES, PhaseTimes
from dpojax.jobs.train.autofit import auto_fit
from dpojax.jobs.train.bounds import batch_problem, check_sizes
from dpojax.jobs.train.callbacks import Dispatcher, builtin_callbacks, check_callbacks
from dpojax.jobs.train.hub_push import PushError, model_card, push_to_hub, write_card
from dpojax.jobs.train.progress import Progress
from dpojax.jobs.train.report import write_report
from dpojax.jobs.train.step_loop import (
    FINISHED_EARLY,
    StepCallback,
    StepLoop,
    logged_metrics,
    workdir_gone,
)
from dpojax.jobs.train.trainer import StepperCache, Trainer
from dpojax.jobs.workdir import (
    atomic_write_text,
    check_config,
    remote,
    replaced_dir,
    settings_text,
    used_settings,
)
from dpojax.jobs.workdir.fingerprint import (
    check_inputs,
    check_processes_agree,
)
from dpojax.jobs.workdir.lock import workdir_lock
from dpojax.jobs.workdir.run_identity import (
    read_run_id,
    restore_checked,
    start_run,
)
from dpojax.runtime import peak_memory
from dpojax.train import hosts
from dpojax.train.checkpoint import Checkpointer, CheckpointError
from dpojax.train.metrics_io import MetricsWriter
from dpojax.train.state import policy_model
from dpojax.train.tracking import make_sinks, parse_report_to

log = logging.getLogger(__name__)


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
            config=schema.as_dict(config),
            resume_step=step,
        )
    return MetricsWriter(workdir, enabled=is_main, resume_step=step, tensorboard=False, sinks=sinks)


def _resuming(workdir: Path) -> bool:
    """Whether the workdir holds a committed checkpoint to resume from."""
    directory = epath.Path(remote.checkpoint_dir(workdir))
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def _finish(config, workdir: Path, trainer: Trainer, run: StepLoop, summary: dict):
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
    config: Config,
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
    (`dpojax.jobs.train.bounds`) unless `batch_over_pairs` (a loop's round: a batch is then all its
    pairs). `steppers`: where the jitted steps of an earlier job of the same settings are kept
    (a loop's rounds share one: a round compiles nothing).

    `callback(step, total_steps, train_metrics, eval_metrics_or_None)` runs after every step and
    after the final evaluation (e.g. progress reporting for the Customizer server); an exception
    it raises ends the run at once (saves in flight are completed, the exception propagates).
    `callbacks`: objects with any of the hooks of `dpojax.jobs.train.callbacks` (on_train_begin,
    on_step_end, on_evaluate, on_save, on_train_end; process 0), which may ask the run to stop
    (as on SIGTERM: "stopped by callback <name>") or to evaluate; the config's own
    (early stopping, the completions log) run first.
    SIGTERM / SIGINT (recorded in `stop`, by default a `StopSignals` of this call) end the run
    after the current step with a checkpoint; a resumed run whose settings differ from the
    workdir's config.json is refused (`dpojax.jobs.workdir.check_config`), as is one whose model
    or data differ from those it started with (`dpojax.jobs.workdir.fingerprint`). The workdir is locked
    for the run (`dpojax.jobs.workdir.lock`): a second run on it stops before writing anything."""
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
            raise workdir_gone(workdir, type(e).__name__) from e


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
                trainer = Trainer(config, workdir, train=True, times=times, steppers=steppers)
                trainer.stepper.adopt(programs)
                _check_batch(config, trainer, batch_over_pairs)
                run = StepLoop(trainer.config, workdir, trainer, callback, run_id)
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


def _summary(workdir: Path, run: StepLoop, status: str, fit) -> dict[str, Any]:
    """summary.json's record of the run (its throughput and phases are added by the caller)."""
    summary = {
        "status": status,
        "step": run.step,
        "total_steps": run.trainer.total_steps,
        "attention": run.trainer.attention,
        "final_train": run.last_train or logged_metrics(workdir, "train", run.step),
        **peak_memory(),
        "timing": run.timer.summary(),
    }
    if fit is not None:
        summary["auto_fit"] = fit
    if run.finished_early is not None:
        summary[FINISHED_EARLY] = run.finished_early
    return summary


def _dispatcher(trainer: Trainer, run: StepLoop, writer, callbacks) -> Dispatcher:
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


def evaluate(config: Config, workdir: str | Path) -> dict[str, float]:
    """Per-pair log-probs and losses of the policy (the workdir's latest checkpoint if any, else
    model.path) on data.eval_path (or data.train_path)."""
    workdir = Path(workdir)
    check_sizes(config)
    trainer = Trainer(config, workdir, train=False)
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


def export(config: Config, workdir: str | Path) -> Path:
    """Exports the workdir's latest checkpoint (or checkpoint `export.step`) as an HF directory
    in WORKDIR/export (WORKDIR/export_step_<step>); no data is read."""
    workdir = Path(workdir)
    check_sizes(config)
    trainer = Trainer(config, workdir, train=False, data=False)
    step = int(config.export.step)
    state = _restored_state(config, trainer, workdir, required=True, step=step or None)
    target = export_dir(workdir, step)
    trainer.export(state, target)
    _write_card(config, target, _export_summary(workdir, state), None)
    hosts.barrier("dpojax export done")
    return target
