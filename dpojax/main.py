"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job: train, evaluate,
export, collect, loop, submit or plan (`dpojax.config.modes`; `dpojax.cli.usage` is the --help
text). Without
--config, a --workdir that holds a run starts from its config.json; --config also takes such a
saved config (`dpojax.jobs.workdir.saved_recipe`). Every mode ends with one line naming what it wrote.
Errors print one line (`--verbose` for the traceback) and exit with a code that says what went
wrong: one table for every mode, with the classification of failures, in `dpojax.errors`
(README.md#exit-codes). SIGTERM or SIGINT at any point ends the run cleanly with exit 0 and a
line saying what was kept and how to go on.

The command applies its runtime settings explicitly: XLA's CPU flags and huge-page malloc
(`dpojax.xla_env`), then `dpojax.jobs.run`: multi-host initialisation and the compilation cache
(`dpojax.runtime`), validation, the job.

In a multi-process run (docs/multihost.md) every log and error line starts with the process
index, and a process that fails exits at once (its error line first) instead of waiting in JAX's
shutdown barrier: the other processes then fail their next collective and stop too, each with
a line that says so (exit code 5).
"""

from __future__ import annotations

import logging
import signal
import sys

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from dpojax.cli import argv as argv_rewrite
from dpojax.cli import error_lines, output, usage
from dpojax.errors import (
    EXIT_CONFIG,
    EXIT_OK,
    interruption_in,
    one_line,
)

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config",
    None,
    "A recipe (configs/*.py, or a shipped one by name: train_pairs), or a saved config: a "
    "run's config.json (or a .yaml file) or its workdir. Left out: the config.json of the run "
    "in --workdir, when there is one. Every key with its default: docs/config.md, or "
    "`python -m dpojax.config`.",
    lock_config=True,
)
flags.DEFINE_string(
    "workdir",
    argv_rewrite.DEFAULT_WORKDIR,
    "Run directory: config.json, checkpoints, metrics, report, exports. A later run of any mode "
    "on it starts from its config.json.",
)
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")


def _load_config():
    try:
        config = FLAGS.config
        if config is not None and not isinstance(config, ml_collections.ConfigDict):
            output.fail(
                error_lines.not_a_config_line(FLAGS["config"].config_filename, config), EXIT_CONFIG
            )
        if config is not None:
            list(config.keys())  # recipes load lazily: surface a broken one here
    except Exception as e:  # noqa: BLE001 - whatever the recipe file raised
        if FLAGS.verbose:
            raise
        output.fail(f"cannot load the config: {one_line(e)}", EXIT_CONFIG)
    if config is None and FLAGS["config"].present:
        output.fail(
            error_lines.not_a_config_line(FLAGS["config"].config_filename, None), EXIT_CONFIG
        )
    if config is None:
        output.fail(
            f"--config is required unless --workdir holds a run (its config.json; "
            f"{FLAGS.workdir} holds none), e.g. --config configs/tiny_test.py",
            EXIT_CONFIG,
        )
    return config


def _wants_debug_logs() -> bool:
    """--verbose, or absl's own --verbosity=1 and up (absl's handler printed DEBUG records then:
    the multi-process tests read each step's pairs from them)."""
    return bool(FLAGS["verbose"].value) or FLAGS["verbosity"].value >= 1


def main(argv: list[str]) -> None:
    from dpojax.interrupts import Interrupted, StopSignals

    if len(argv) > 1:
        output.fail(
            f"unexpected arguments {argv[1:]}; options are --config, --workdir, --verbose", 2
        )
    from dpojax.runtime import configure_cli_logging

    configure_cli_logging(_wants_debug_logs())  # `time level message` (absl's carry thread ids)
    if not FLAGS.verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(output.OneLineLibraryLogs())
        sys.excepthook = output.quiet_excepthook(set())
        # "Task exception was never retrieved" at exit, after a failed background save.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    # A signal outside a job's own handling (start-up, a job with nothing to save) ends the run
    # here; jobs with state to keep record signals themselves and stop at a safe point. Once
    # the job is over, a late signal is ignored (the handlers StopSignals restores on exit), so
    # it cannot kill the process during its exit and change the exit status.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        with StopSignals(interrupt=True):
            config = _load_config()
            output.run_reporting(config, FLAGS.workdir, FLAGS.verbose)
    except Interrupted as e:
        output.stopped_before_the_job(e.signal_name, FLAGS.verbose)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line; a stop
    signal while the recipe loads is the stop (its line, exit 0)."""
    from dpojax.interrupts import StopSignals

    argv = argv_rewrite.with_recipe_name(argv)
    try:
        with StopSignals(interrupt=True):
            return FLAGS(argv_rewrite.with_saved_config(argv))
    except KeyboardInterrupt as e:
        output.stopped_before_the_job(getattr(e, "signal_name", "SIGINT"), "--verbose" in argv)
    except Exception as e:  # noqa: BLE001 - absl/ml_collections raise many types here
        interrupted = interruption_in(e)
        if interrupted is not None:  # wrapped by the recipe loader
            output.stopped_before_the_job(
                getattr(interrupted, "signal_name", "SIGINT"), "--verbose" in argv
            )
        if "--verbose" in argv:
            raise
        print(f"dpojax: error: {error_lines.flags_line(argv, e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def cli() -> None:
    from dpojax import runtime, xla_env

    xla_env.reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    xla_env.apply_cpu_flags()  # before JAX creates its backends
    # absl's --helpfull prints the main module's docstring: `dpojax` as `python -m ...`
    sys.modules["__main__"].__doc__ = usage.usage()
    argv = [("--verbose" if arg == "-v" else arg) for arg in sys.argv]  # (absl's -v: verbosity)
    if any(arg in usage.HELP_ARGS for arg in argv[1:]):
        flag_help = FLAGS.module_help(FLAGS.find_module_defining_flag("workdir"))
        print(usage.help_text(usage.program(argv[0]), flag_help))
        sys.exit(EXIT_OK)  # (absl's own --help exits 1)
    runtime.quiet_library_notices()  # before transformers is imported
    app.run(main, argv=argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
