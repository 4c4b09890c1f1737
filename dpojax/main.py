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

import importlib.machinery
import logging
import os
import re
import signal
import sys
import traceback
import types
from pathlib import Path

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from dpojax.errors import (
    EXIT_CONFIG,
    EXIT_OK,
    ConfigErrors,
    ConfigProblem,
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
    "runs/default",
    "Run directory: config.json, checkpoints, metrics, report, exports. A later run of any mode "
    "on it starts from its config.json.",
)
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")


class _OneLineLibraryLogs(logging.Filter):
    """Without --verbose, a library's log record keeps its first line: no tracebacks from
    background threads (a checkpoint save failing on a full disk logged hundreds of lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("dpojax") and (record.exc_info or "\n" in str(record.msg)):
            record.msg = (record.getMessage().splitlines() or [""])[0]
            record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        return True


def _quiet_excepthook(seen: set[str]):
    """Without --verbose, an exception that reaches the top of a thread or a library callback
    prints one line, once (after a failed checkpoint save, the library's callbacks raised the
    same error dozens of times)."""

    def hook(kind, value, tb) -> None:
        line = one_line(f"{kind.__name__}: {value}")
        if line not in seen:
            seen.add(line)
            print(f"dpojax: {line}", file=sys.stderr)

    return hook


def _quiet_teardown() -> None:
    """Without --verbose, once the job has ended: library log records are teardown noise (the
    checkpoint library's threads log errors at interpreter shutdown), so the run's last line is
    dpojax's own."""
    if not FLAGS["verbose"].value:  # (its default before the flags are parsed)
        for name in ("absl", "orbax", "jax", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _print_last(line: str) -> None:
    """Prints `line` as the run's last line on stderr: stderr is pointed at the null device
    first and `line` written to a copy of it, so that library threads still winding down (the
    checkpoint library's "Event loop is closed" tracebacks, printed from its own threads after
    an interrupted restore) cannot write after it."""
    sys.stderr.flush()
    original = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    os.write(original, (line + "\n").encode())
    os.close(original)


def _label() -> str:
    from dpojax.runtime import process_label

    label = process_label()
    return f"{label} " if label else ""


def _print_error(message: str) -> None:
    print(f"dpojax: error: {_label()}{message}", file=sys.stderr)


def _exit(code: int, *, at_once: bool = False) -> None:
    """sys.exit, or os._exit once the output is flushed: in a multi-process run (JAX's shutdown
    barrier would otherwise wait for processes that may be gone) and, with `at_once`, after a
    stop, when the job has closed all it writes: the interpreter's teardown would only add the
    libraries' noise after the stop line (the checkpoint library's threads print "Event loop is
    closed") or race XLA's compile threads."""
    if not (at_once or _label()):
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(message: str, code: int) -> None:
    _print_error(message)
    _exit(code)


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
            _fail(_not_a_config_line(FLAGS["config"].config_filename, config), EXIT_CONFIG)
        if config is not None:
            list(config.keys())  # recipes load lazily: surface a broken one here
    except Exception as e:  # noqa: BLE001 - whatever the recipe file raised
        if FLAGS.verbose:
            raise
        _fail(f"cannot load the config: {one_line(e)}", EXIT_CONFIG)
    if config is None and FLAGS["config"].present:
        _fail(_not_a_config_line(FLAGS["config"].config_filename, None), EXIT_CONFIG)
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
        print(f"dpojax: {_label()}{line}", file=sys.stderr)
        _exit(EXIT_OK, at_once=True)
    from dpojax.jobs import outputs_line

    print(f"dpojax: {_label()}{outputs_line(config.mode, result, workdir)}", file=sys.stderr)


def _run_reporting(config) -> None:
    """Runs the job and maps every failure to one line and its exit code."""
    try:
        _run_and_report(config)
    except ConfigErrors as e:
        for line in e.errors:
            _print_error(line)
        _exit(EXIT_CONFIG)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its line and exit code
        code = exit_code_of(e, multi_process=bool(_label()))
        interrupted = interruption_in(e) if code is None else None
        if interrupted is not None:  # an unexpected error a stop signal caused: the stop (main)
            raise interrupted from None
        if FLAGS.verbose or code is None:
            if not _label():
                raise
            traceback.print_exc()  # then exit at once: see _exit
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
            handler.addFilter(_OneLineLibraryLogs())
        sys.excepthook = _quiet_excepthook(set())
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
    _print_last(
        f"dpojax: stopped by {signal_name} before the job had anything to save; rerun "
        "the same command to start it again"
    )
    _exit(EXIT_OK, at_once=True)


def _override_hint(argv: list[str], text: str) -> str | None:
    """For an unknown `--config.a.b=...` override: the line naming the whole key and the
    suggestion, in the words of the config checks."""
    names = re.findall(r"'([^']+)'", text) + re.findall(r'"([^"]+)"', text)
    if not names:
        return None
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and match.group(1).split(".")[-1] == names[0]:
            key = match.group(1)
            hint = ""
            if len(names) > 1 and names[1] != names[0]:
                hint = f"; did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}"
                hint += f"{names[1]}'?"
            return f"config key '{key}' is unknown{hint}"
    return None


def _flag_value(argv: list[str], name: str) -> tuple[int, int, str] | None:
    """(first index, last index + 1, value) of the last `--name=value` or `--name value`."""
    found = None
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith(f"--{name}="):
            found = (i, i + 1, arg.split("=", 1)[1])
        elif arg == f"--{name}" and i + 1 < len(argv):
            found = (i, i + 2, argv[i + 1])
    return found


def _check_saved(source: str) -> None:
    """Exits with one line per problem of the saved config `source` (the flag parser would wrap
    them in the loader's traceback)."""
    from dpojax.jobs.workdir import saved_config

    try:
        saved_config(source)
    except ConfigErrors as e:
        for line in e.errors:
            print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _pulled(workdir: str) -> str:
    """`workdir`, or for an object-store URL the local mirror it is pulled into (where its
    config.json is read from)."""
    from dpojax.jobs import remote

    if not remote.is_url(workdir):
        return workdir
    try:
        return str(remote.pulled(workdir))
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _with_recipe_name(argv: list[str]) -> list[str]:
    """`argv` with a --config that names a shipped recipe (`--config train_pairs`, also with
    `:ARG`) given as its file (`dpojax.config.recipes`); a path that exists wins. Exits with the
    shipped names for a bare name or a `.py` file that is neither."""
    from dpojax.config import recipes

    given = _flag_value(argv, "config")
    if given is None:
        return argv
    start, end, value = given
    if "://" in value:  # a run's workdir in a bucket (`_with_saved_config`)
        return argv
    name, colon, arg = value.partition(":")
    try:
        path = recipes.source(name)
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if path == Path(name):
        return argv
    return [*argv[:start], f"--config={path}{colon}{arg}", *argv[end:]]


def _with_saved_config(argv: list[str]) -> list[str]:
    """`argv` with a saved config loaded as a recipe (`dpojax.jobs.saved_recipe`): the file or
    workdir that --config names when it is no recipe (.json, .yaml, .yml, a directory), or,
    without --config, the --workdir's config.json when it holds a run."""
    from dpojax.jobs import saved_recipe
    from dpojax.jobs.workdir import CONFIG_FILE, SAVED_SUFFIXES

    recipe = saved_recipe.__file__
    given = _flag_value(argv, "config")
    if given is not None:
        start, end, value = given
        value = _pulled(value)  # a run's workdir in a bucket: its local mirror
        if value.endswith(SAVED_SUFFIXES) or os.path.isdir(value):
            _check_saved(value)
            return [*argv[:start], f"--config={recipe}:{value}", *argv[end:]]
        return argv
    workdir = (_flag_value(argv, "workdir") or (0, 0, FLAGS["workdir"].default))[2]
    workdir = _pulled(workdir)
    if not os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
        return argv
    _check_saved(workdir)
    print(
        f"dpojax: starting from {os.path.join(workdir, CONFIG_FILE)}, the run's saved config "
        "(--config.<key>=<value> changes a key)",
        file=sys.stderr,
    )
    return [argv[0], f"--config={recipe}:{workdir}", *argv[1:]]


def _unknown_key_line(argv: list[str], text: str) -> str | None:
    """For an override of a key the config tree does not have at all (`--config.eps=...`,
    `--config.mesh.context=...`: reported by the flag parser as just the missing name): the line
    naming the whole key and the closest key, or where every key is listed."""
    from dpojax import schema
    from dpojax.config.tree import all_keys

    name = text.strip().strip("'\"")
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and name in match.group(1).split("."):
            key = match.group(1)
            close = schema.closest_key(key, [k.name for k in all_keys()])
            hint = (
                f"; did you mean '{close}'?"
                if close
                else ": every key with its default is in docs/config.md (`python -m dpojax.config`)"
            )
            return f"config key '{key}' is unknown{hint}"
    return None


def _recipe_line(argv: list[str], error: BaseException, text: str) -> str | None:
    """For an error raised by the recipe file's own code (its `get_config`): the file and line
    that raised it, the error and, for a missing config key, what to check."""
    given = _flag_value(argv, "config")
    if given is None:
        return None
    recipe = given[2].split(":", 1)[0]  # a recipe may take an argument: FILE:ARG
    lines = [
        f.lineno
        for f in traceback.extract_tb(error.__traceback__)
        if os.path.realpath(f.filename) == os.path.realpath(recipe)
    ]
    if not lines:
        return None
    line = f"{recipe}:{lines[-1]}: the recipe raised {type(error).__name__}: {text}"
    if isinstance(error, AttributeError | KeyError):
        line += (
            " (a config key or section the config does not have: `python -m dpojax.config` "
            "lists every key; a workflow's collect.<name>.* keys exist once it is registered)"
        )
    return line


def _not_a_config_line(recipe: str, result: object) -> str:
    """The line for a recipe whose get_config() returned `result`, which is no ConfigDict."""
    got = "None (is its return statement missing?)" if result is None else type(result).__name__
    return (
        f"{recipe}: get_config() returned {got}; a recipe must return an "
        "ml_collections.ConfigDict: start from dpojax.config.default_config(), change it and "
        "return it (configs/tiny_test.py)"
    )


def _recipe_result_line(argv: list[str]) -> str | None:
    """For a --config recipe (FILE or FILE:ARG, a .py file) that defines no get_config() or
    whose get_config() returns no ConfigDict: the line naming the file and what a recipe must
    return. None where the recipe is fine, or raises (`_recipe_line` names that)."""
    given = _flag_value(argv, "config")
    if given is None:
        return None
    recipe, colon, arg = given[2].partition(":")
    if not recipe.endswith(".py") or not os.path.isfile(recipe):
        return None
    try:
        loader = importlib.machinery.SourceFileLoader("_dpojax_recipe_check", recipe)
        module = types.ModuleType(loader.name)
        loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            return (
                f"{recipe} defines no get_config(): a recipe is a Python file whose "
                "get_config() returns an ml_collections.ConfigDict (start from "
                "dpojax.config.default_config(); configs/tiny_test.py)"
            )
        result = module.get_config(arg) if colon else module.get_config()
    except Exception:  # noqa: BLE001 - an error of the recipe's own code: _recipe_line's case
        return None
    if isinstance(result, ml_collections.ConfigDict):
        return None
    return _not_a_config_line(recipe, result)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line; a stop
    signal while the recipe loads is the stop (its line, exit 0)."""
    from dpojax.interrupts import StopSignals

    argv = _with_recipe_name(argv)
    try:
        with StopSignals(interrupt=True):
            return FLAGS(_with_saved_config(argv))
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
            _recipe_result_line(argv)
            or _override_hint(argv, text)
            or _unknown_key_line(argv, text)
            or _recipe_line(argv, e, text)
            or f"bad command line or config: {text}"
        )
        print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def usage() -> str:
    """The text of --help (absl prints it before the flags)."""
    from dpojax.config.modes import SUMMARIES

    width = max(map(len, SUMMARIES))
    modes = "\n".join(f"  {mode:<{width}}  {line}" for mode, line in SUMMARIES.items())
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
