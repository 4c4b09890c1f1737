"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job: train, evaluate,
export, collect, loop, submit or plan (`dpojax.jobs`; `usage()` is the --help text). Without
--config, a --workdir that holds a run starts from its config.json; --config also takes such a
saved config (`dpojax.jobs.saved_recipe`). Every mode ends with one line naming what it wrote.
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
import os
import signal
import sys
import traceback

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from dpojax.cli import argv as argv_rewrite
from dpojax.cli import error_lines, output
from dpojax.errors import (
    EXIT_CONFIG,
    EXIT_OK,
    ConfigErrors,
    exit_code_of,
    exit_line,
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


def _quiet_teardown() -> None:
    """Without --verbose, once the job has ended: library log records are teardown noise (the
    checkpoint library's threads log errors at interpreter shutdown), so the run's last line is
    dpojax's own."""
    if not FLAGS["verbose"].value:  # (its default before the flags are parsed)
        for name in ("absl", "orbax", "jax", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _fail(message: str, code: int) -> None:
    output.print_error(message)
    output.exit_process(code)


def run(config, workdir: str) -> object:
    """`dpojax.jobs.run`: validates `config` and runs its mode (imported when called, so that
    the command line sets XLA's flags before JAX is imported)."""
    from dpojax.jobs import run as run_job

    return run_job(config, workdir)


def _stopped_line(mode: str, result: object, workdir: str) -> str | None:
    """The line printed after a job that a signal stopped (None: it was not stopped)."""
    from dpojax.jobs import stop_summary

    return stop_summary(mode, result, workdir)


def _load_config():
    try:
        config = FLAGS.config
        if config is not None and not isinstance(config, ml_collections.ConfigDict):
            _fail(
                error_lines.not_a_config_line(FLAGS["config"].config_filename, config), EXIT_CONFIG
            )
        if config is not None:
            list(config.keys())  # recipes load lazily: surface a broken one here
    except Exception as e:  # noqa: BLE001 - whatever the recipe file raised
        if FLAGS.verbose:
            raise
        _fail(f"cannot load the config: {one_line(e)}", EXIT_CONFIG)
    if config is None and FLAGS["config"].present:
        _fail(error_lines.not_a_config_line(FLAGS["config"].config_filename, None), EXIT_CONFIG)
    if config is None:
        _fail(
            f"--config is required unless --workdir holds a run (its config.json; "
            f"{FLAGS.workdir} holds none), e.g. --config configs/tiny_test.py",
            EXIT_CONFIG,
        )
    return config


def _run_and_report(config) -> None:
    """Runs the job; after a stop, the line saying how to go on."""
    workdir = FLAGS.workdir
    try:
        result = run(config, workdir)
    finally:
        _quiet_teardown()
    line = _stopped_line(config.mode, result, workdir)
    if line:
        print(f"dpojax: {output.label()}{line}", file=sys.stderr)
        output.exit_process(EXIT_OK, at_once=True)
    from dpojax.jobs import outputs_line

    print(f"dpojax: {output.label()}{outputs_line(config.mode, result, workdir)}", file=sys.stderr)


def _run_reporting(config) -> None:
    """Runs the job and maps every failure to one line and its exit code."""
    try:
        _run_and_report(config)
    except ConfigErrors as e:
        for line in e.errors:
            output.print_error(line)
        output.exit_process(EXIT_CONFIG)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its line and exit code
        code = exit_code_of(e, multi_process=bool(output.label()))
        interrupted = interruption_in(e) if code is None else None
        if interrupted is not None:  # an unexpected error a stop signal caused: the stop (main)
            raise interrupted from None
        if FLAGS.verbose or code is None:
            if not output.label():
                raise
            traceback.print_exc()  # then exit at once: see output.exit_process
            _fail(f"{type(e).__name__}: {one_line(e)[:500]}", code or 1)
        _fail(exit_line(e, code, FLAGS.workdir), code)


def _wants_debug_logs() -> bool:
    """--verbose, or absl's own --verbosity=1 and up (absl's handler printed DEBUG records then:
    the multi-process tests read each step's pairs from them)."""
    return bool(FLAGS["verbose"].value) or FLAGS["verbosity"].value >= 1


def main(argv: list[str]) -> None:
    from dpojax.interrupts import Interrupted, StopSignals

    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; options are --config, --workdir, --verbose", 2)
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
            _run_reporting(config)
    except Interrupted as e:
        _stopped_before_the_job(e.signal_name)


def _stopped_before_the_job(signal_name: str) -> None:
    """The stop line of a signal that came before the job had anything to save (the recipe
    loading, start-up, a job with nothing to keep), then exit 0."""
    _quiet_teardown()
    output.print_last(
        f"dpojax: stopped by {signal_name} before the job had anything to save; rerun "
        "the same command to start it again"
    )
    output.exit_process(EXIT_OK, at_once=True)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line; a stop
    signal while the recipe loads is the stop (its line, exit 0)."""
    from dpojax.interrupts import StopSignals

    argv = argv_rewrite.with_recipe_name(argv)
    try:
        with StopSignals(interrupt=True):
            return FLAGS(argv_rewrite.with_saved_config(argv))
    except KeyboardInterrupt as e:
        _stopped_before_the_job(getattr(e, "signal_name", "SIGINT"))
    except Exception as e:  # noqa: BLE001 - absl/ml_collections raise many types here
        interrupted = interruption_in(e)
        if interrupted is not None:  # wrapped by the recipe loader
            _stopped_before_the_job(getattr(interrupted, "signal_name", "SIGINT"))
        if "--verbose" in argv:
            raise
        text = one_line(e)
        line = (
            error_lines.recipe_result_line(argv)
            or error_lines.override_hint(argv, text)
            or error_lines.unknown_key_line(argv, text)
            or error_lines.recipe_line(argv, e, text)
            or f"bad command line or config: {text}"
        )
        print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def usage() -> str:
    """The text of --help (absl prints it before the flags)."""
    from dpojax.config.modes import MODE_RECORDS

    width = max(map(len, MODE_RECORDS))
    modes = "\n".join(f"  {name:<{width}}  {m.summary}" for name, m in MODE_RECORDS.items())
    return f"""dpojax: DPO training in JAX for TPUs, GPUs and CPUs.

  python -m dpojax.main --config configs/<recipe>.py --workdir DIR [--config.<key>=<value> ...]
  python -m dpojax.main --workdir DIR --config.mode=evaluate   (or export: a run's workdir alone)

Modes (--config.mode=<mode>):
{modes}

Any mode run on a workdir that holds a run starts from that run's WORKDIR/config.json, with the
--config.<key>=<value> flags on top; --config also takes a saved config (config.json, .yaml).
Every key with its default and meaning: docs/config.md, or print them with
`python -m dpojax.config`. Exit codes: README.md#exit-codes. -v (--verbose) prints tracebacks
and debug logs.
"""


HELP_ARGS = ("--help", "-h", "-?", "--helpshort")


def _program(argv0: str) -> str:
    return "dpojax" if os.path.basename(argv0) == "dpojax" else "python -m dpojax.main"


def help_text(program: str) -> str:
    """`usage()` and the command's options (absl heads them with the module's file path)."""
    flag_help = FLAGS.module_help(FLAGS.find_module_defining_flag("workdir"))
    options = [line for line in flag_help.splitlines() if line.startswith(" ")]
    text = usage().replace("python -m dpojax.main", program)
    return f"{text}\noptions:\n" + "\n".join(options) + "\n  -v: the same as --verbose\n"


def cli() -> None:
    from dpojax import runtime, xla_env

    xla_env.reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    xla_env.apply_cpu_flags()  # before JAX creates its backends
    sys.modules["__main__"].__doc__ = usage()  # absl's --helpfull: `dpojax` as `python -m ...`
    argv = [("--verbose" if arg == "-v" else arg) for arg in sys.argv]  # (absl's -v: verbosity)
    if any(arg in HELP_ARGS for arg in argv[1:]):
        print(help_text(_program(argv[0])))
        sys.exit(EXIT_OK)  # (absl's own --help exits 1)
    runtime.quiet_library_notices()  # before transformers is imported
    app.run(main, argv=argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
