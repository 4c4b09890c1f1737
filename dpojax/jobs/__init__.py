"""The jobs behind `config.mode`: one function `(config, workdir) -> result` per mode, taking the
typed config (`dpojax.config.Config`) that `run` validates and freezes once: the one door.

The modes are the records of `dpojax.config.modes.MODE_RECORDS` (each with its job, its `--help`
line, its outputs and its line after a signal; docs/config.md#modes shows them as a table).
A package per job family, its helpers inside: `train` (the train, evaluate and export jobs, the
`Trainer` that holds what one of them needs, the step loop, callbacks, auto-fit, reports),
`rounds` (collect and loop), `plan`, and the module `submit`; `workdir` holds what a workdir
keeps between runs (lock, run identity, saved recipe, fingerprints, the object-store mirror).
`dpojax.jobs.build` turns a validated config into the objects a job needs. Job modules are
imported when their mode runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import ml_collections

from dpojax.config import Config
from dpojax.config.modes import MODE_RECORDS, MODES  # noqa: F401 - MODES: the names of the jobs


def stop_summary(mode: str, result: Any, workdir: str | Path) -> str | None:
    """The line that tells how a job a signal stopped can go on (None: it was not stopped): its
    mode's `stopped` line, filled from the result and the workdir."""
    from dpojax.jobs.workdir.remote import joined

    status = result.get("status") if isinstance(result, dict) else None
    if not isinstance(status, str) or not status.startswith("stopped by"):
        return None
    step = result.get("step", 0)
    fields = {
        "total_steps": "?",
        "rounds_done": 0,
        **result,
        "step": step,
        "mode": mode,
        "workdir": workdir,
        "checkpoint": (
            f"the checkpoint of step {step} is in {joined(workdir, 'checkpoints')}"
            if step
            else "no step was taken"
        ),
    }
    return MODE_RECORDS[mode].stopped.format(**fields)


def outputs_line(mode: str, result: Any, workdir: str | Path) -> str:
    """The last line of a job that ran to its end: what it did and the outputs it left in the
    workdir (those of its mode's `outputs` that exist)."""
    from dpojax.jobs.workdir.remote import holds, joined

    status = result.get("status") if isinstance(result, dict) else None
    head = f"{mode} {status or 'done'}"
    if mode == "train" and isinstance(result, dict) and "step" in result:
        head += f" at step {result['step']} of {result.get('total_steps', '?')}"
    if mode == "evaluate" and isinstance(result, dict) and "loss" in result:
        accuracy = result.get("rewards/accuracies")
        head += f" (loss {result['loss']:.4f}" + (
            f", accuracy {accuracy:.3f})" if accuracy is not None else ")"
        )
    names = MODE_RECORDS[mode].outputs if mode in MODE_RECORDS else ()
    if mode == "export" and isinstance(result, (str, Path)):  # export_step_<step> for a step
        names = (Path(result).name,)
    found = [joined(workdir, name) for name in names if holds(workdir, name)]
    for name in ("training_file", "validation_file"):  # submit's result names its files
        if getattr(result, name, None):
            found.append(str(getattr(result, name)))
    return f"{head}; wrote {', '.join(found)}" if found else f"{head}; wrote nothing in {workdir}"


def run_job(config: Config, workdir: str | Path, **options: Any) -> Any:
    """Runs the job of `config.mode` with the typed config (validated and frozen already, by
    `run`); `options` go to the job (train's `callback`)."""
    module, _, function = MODE_RECORDS[config.mode].job.partition(":")
    return getattr(importlib.import_module(module), function)(config, workdir, **options)


def compilation_cache_setting(config) -> str:
    """`compilation_cache_dir`, or "" (no cache) for a plan of compile-only devices
    (`plan.target` tpu:... or gpu:...): their compiler cannot load a cached executable (JAX warns
    "PjRtCompiler must be constructed with a Client" on every hit and compiles again)."""
    compile_only = config.mode == "plan" and config.plan.target.startswith(("gpu:", "tpu:"))
    return "" if compile_only else config.compilation_cache_dir


def run(config: ml_collections.ConfigDict, workdir: str | Path, **options: Any) -> Any:
    """Initialises JAX's runtime, validates `config` (raising `ConfigErrors`), freezes it into the
    typed config every job takes (`dpojax.config.frozen`) and runs its mode: the one door of the
    command line, `dpojax.api` and the Customizer server."""
    from dpojax import runtime
    from dpojax.config import check_keys, frozen, validate
    from dpojax.errors import ConfigErrors
    from dpojax.jobs.workdir import check_workdir, remote

    remote.check(workdir)
    runtime.quiet_library_notices()  # orbax's warning at each save between evaluations
    errors = check_keys(config)
    if errors:
        raise ConfigErrors(errors)
    if config.mode == "plan" and config.plan.target.startswith("tpu:"):
        runtime.prepare_tpu_compile_host(config.plan.target.removeprefix("tpu:"))
    if config.mode == "plan" and config.plan.target.startswith("gpu:"):
        runtime.prepare_gpu_compile_host()  # it needs the CUDA plugin
    elif config.mode != "plan" or config.plan.target == "local":
        runtime.skip_accelerator_plugins()
    runtime.initialize_distributed(config)  # before any JAX computation

    import jax

    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ConfigErrors(errors)
    with remote.mirrored(workdir, processes=jax.process_count()) as local:
        check_workdir(local)
        runtime.enable_compilation_cache(
            compilation_cache_setting(config),
            local,
            min_compile_seconds=config.compilation_cache_min_seconds,
        )
        return run_job(frozen(config), local, **options)
