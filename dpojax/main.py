"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job: train, evaluate,
export, collect, loop or submit (`dpojax.jobs`). Errors print one line (`--verbose` for the
traceback) and exit with a code that says what went wrong (`EXIT_*` below; the Customizer's own
codes are in `dpojax.customizer.client.errors`).

The command applies its runtime settings explicitly: XLA's CPU flags and huge-page malloc
(`dpojax.xla_env`), then multi-host initialisation and the compilation cache
(`dpojax.runtime`), then validation, then the job.

In a multi-process run (docs/multihost.md) every log and error line starts with the process
index, and a process that fails exits at once (its error line first) instead of waiting in JAX's
shutdown barrier: the other processes then fail their next collective and stop too, each with
a line that says so (exit code 5).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Run directory: checkpoints, metrics, exports.")
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")

EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE, EXIT_DISTRIBUTED, EXIT_PUSH = 2, 3, 4, 5, 6


def _one_line(e: BaseException) -> str:
    text = str(e).replace("\\n", " ").replace("\\'", "'")
    return " ".join(text.split()).strip("'\"")


def _label() -> str:
    from dpojax.runtime import process_label

    label = process_label()
    return f"{label} " if label else ""


def _print_error(message: str) -> None:
    print(f"dpojax: error: {_label()}{message}", file=sys.stderr)


def _exit(code: int) -> None:
    """sys.exit, or in a multi-process run os._exit once the output is flushed: JAX's shutdown
    barrier would otherwise wait for processes that may be gone."""
    if not _label():
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(message: str, code: int) -> None:
    _print_error(message)
    _exit(code)


class ConfigErrors(ValueError):
    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def run(config, workdir: str) -> object:
    """Initialises JAX's runtime, validates `config` and runs its mode; the library entry point
    behind the CLI."""
    from dpojax import runtime
    from dpojax.config import check_keys, validate
    from dpojax.jobs import run_job

    errors = check_keys(config)
    if errors:
        raise ConfigErrors(errors)
    if config.mode == "plan" and config.plan.target.startswith("tpu:"):
        runtime.prepare_tpu_compile_host(config.plan.target.removeprefix("tpu:"))
    runtime.initialize_distributed(config)  # before any JAX computation

    import jax

    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ConfigErrors(errors)
    runtime.enable_compilation_cache(
        config.compilation_cache_dir,
        workdir,
        min_compile_seconds=config.compilation_cache_min_seconds,
    )
    return run_job(config, workdir)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; options are --config, --workdir, --verbose", 2)
    logging.basicConfig(
        level=logging.DEBUG if FLAGS.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("absl", "jax._src", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = FLAGS.config
        if config is not None:
            list(config.keys())  # recipes load lazily: surface a broken one here
    except Exception as e:  # noqa: BLE001 - whatever the recipe file raised
        if FLAGS.verbose:
            raise
        _fail(f"cannot load the config: {_one_line(e)}", EXIT_CONFIG)
    if config is None:
        _fail("--config is required, e.g. --config configs/tiny_test.py", EXIT_CONFIG)
    try:
        run(config, FLAGS.workdir)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its line and exit code
        if isinstance(e, ConfigErrors):
            for line in e.errors:
                _print_error(line)
            _exit(EXIT_CONFIG)
        if FLAGS.verbose or _exit_code(e) is None:
            if not _label():
                raise
            traceback.print_exc()  # then exit at once: see _exit
            _fail(f"{type(e).__name__}: {_one_line(e)[:500]}", _exit_code(e) or 1)
        _fail(_message(e), _exit_code(e))


def _exit_code(e: Exception) -> int | None:
    """The exit code of an expected failure; None for anything else (a traceback)."""
    from dpojax.customizer.client.errors import CustomizerError
    from dpojax.data.problems import DataError
    from dpojax.jobs.hub_push import PushError
    from dpojax.jobs.plan import PlanError
    from dpojax.jobs.train import NonFiniteError
    from dpojax.models import CheckpointError
    from dpojax.runtime import DistributedError
    from dpojax.train.tracking import TrackerError

    if isinstance(e, PlanError | TrackerError):  # a plan the target cannot hold, a tracker
        return EXIT_CONFIG  # that cannot be used: config problems
    if isinstance(e, CustomizerError):
        return e.exit_code
    if isinstance(e, PushError):  # the run and its export are complete
        return EXIT_PUSH
    if isinstance(e, DataError | CheckpointError | FileNotFoundError | ValueError):
        return EXIT_DATA
    if isinstance(e, NonFiniteError):
        return EXIT_NONFINITE
    if isinstance(e, DistributedError) or (_label() and _is_jax_runtime_error(e)):
        return EXIT_DISTRIBUTED
    return None


def _is_jax_runtime_error(e: Exception) -> bool:
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError)


def _message(e: Exception) -> str:
    if _label() and _is_jax_runtime_error(e):
        return (
            f"an operation across the processes failed ({_one_line(e)[:300]}): another process "
            "has probably stopped or crashed (see its log). Every process stops; restart all of "
            "them with the same command to resume from the workdir's last checkpoint"
        )
    return str(e)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line."""
    try:
        return FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - absl/ml_collections raise many types here
        if "--verbose" in argv:
            raise
        print(f"dpojax: error: bad command line or config: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def cli() -> None:
    from dpojax import xla_env

    xla_env.reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    xla_env.apply_cpu_flags()  # before JAX creates its backends
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
