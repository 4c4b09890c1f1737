"""dpojax command line: `python -m dpojax.main --config configs/<recipe>.py --workdir DIR`.

Overrides: `--config.optim.learning_rate=1e-5`. `config.mode` picks the job: train, evaluate,
export, collect, loop or submit (`dpojax.jobs`). Errors print one line (`--verbose` for the
traceback) and exit with a code that says what went wrong (`EXIT_*` below; the Customizer's own
codes are in `dpojax.customizer.client.errors`). SIGTERM or SIGINT at any point ends the run
cleanly with exit 0 and a line saying what was kept and how to go on (README.md#exit-codes).

The command applies its runtime settings explicitly: XLA's CPU flags and huge-page malloc
(`dpojax.xla_env`), then multi-host initialisation and the compilation cache
(`dpojax.runtime`), then validation, then the job.

In a multi-process run (docs/multihost.md) every log and error line starts with the process
index, and a process that fails exits at once (its error line first) instead of waiting in JAX's
shutdown barrier: the other processes then fail their next collective and stop too, each with
a line that says so (exit code 5).
"""

from __future__ import annotations

import ast
import errno
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Run directory: checkpoints, metrics, exports.")
flags.DEFINE_bool("verbose", False, "Print tracebacks and debug logs.")

# 0: done, or stopped cleanly by SIGTERM / SIGINT. 5: a multi-process run lost a process.
# 6: the run and its export are complete but the push to the Hub failed. 74 is sysexits.h's
# EX_IOERR: the workdir cannot be written.
EXIT_OK, EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE, EXIT_DISTRIBUTED, EXIT_PUSH = 0, 2, 3, 4, 5, 6
EXIT_IO = 74

# errno values that mean "the workdir cannot be written" (reported with EXIT_IO).
_IO_ERRNOS = {
    errno.ENOSPC: "free space on that disk (or use another --workdir), then rerun the same "
    "command: it resumes from the last complete checkpoint",
    errno.EDQUOT: "raise the disk quota (or use another --workdir), then rerun the same command",
    errno.EACCES: "make it writable for this user, or choose another --workdir",
    errno.EPERM: "make it writable for this user, or choose another --workdir",
    errno.EROFS: "the file system is read-only: choose another --workdir",
    errno.ENOTDIR: "a file is in the way of a directory: move it, or choose another --workdir",
    errno.EEXIST: "a file is in the way of a directory: move it, or choose another --workdir",
    errno.EISDIR: "a directory is where a file should be: move it, or choose another --workdir",
    errno.EIO: "the disk reported an I/O error: check it, or choose another --workdir",
}
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"]+)(?:: '([^']+)')?")
# How the checkpoint library (tensorstore) words an OS error: `... file "PATH" ... [os_error_code='28']`.
_TENSORSTORE_TEXT = re.compile(r'file "([^"]+)".*?\[os_error_code=.?(\d+)')


def _unquote(text: str) -> str:
    """`text` without the repr quoting that KeyError / AttributeError(e) wrap messages in."""
    for _ in range(3):
        t = text.strip()
        if len(t) < 2 or t[0] != t[-1] or t[0] not in "'\"":
            break
        try:
            inner = ast.literal_eval(t)
        except (ValueError, SyntaxError):
            break
        if not isinstance(inner, str):
            break
        text = inner
    return text


def _one_line(e: BaseException | str) -> str:
    """The message of `e` on one line, with its quotes balanced."""
    return " ".join(_unquote(str(e)).split())


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
        line = _one_line(f"{kind.__name__}: {value}")
        if line not in seen:
            seen.add(line)
            print(f"dpojax: {line}", file=sys.stderr)

    return hook


def _quiet_teardown() -> None:
    """Without --verbose, once the job has ended: library log records are teardown noise (the
    checkpoint library's threads log errors at interpreter shutdown), so the run's last line is
    dpojax's own."""
    if not FLAGS.verbose:
        for name in ("absl", "orbax", "jax", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


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


def io_error(e: BaseException) -> OSError | None:
    """The OSError behind `e` that means "cannot write" (searched through causes and contexts,
    and in the text of errors re-raised from other threads), or None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _IO_ERRNOS:
            return e
        text = str(e)
        match = _ERRNO_TEXT.search(text)
        if match and int(match.group(1)) in _IO_ERRNOS:
            return OSError(int(match.group(1)), match.group(2).strip(), match.group(3))
        match = _TENSORSTORE_TEXT.search(text)
        if match and int(match.group(2)) in _IO_ERRNOS:
            code = int(match.group(2))
            return OSError(code, os.strerror(code), match.group(1))
        e = e.__cause__ or e.__context__
    return None


def io_message(err: OSError, workdir: str | os.PathLike) -> str:
    """One line: the path, what went wrong and the fix."""
    path = err.filename or workdir
    reason = err.strerror or os.strerror(err.errno or 0)
    return f"cannot write {path}: {reason}; {_IO_ERRNOS.get(err.errno, 'check the workdir')}"


def check_workdir(workdir: str | os.PathLike) -> None:
    """Raises the OSError that writing into `workdir` would meet (a file in its place, no
    permission, a read-only disk), before any compute."""
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".dpojax-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
    finally:
        probe.unlink(missing_ok=True)


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
    if config.mode == "plan" and config.plan.target.startswith("gpu:"):
        runtime.prepare_gpu_compile_host()
    runtime.initialize_distributed(config)  # before any JAX computation

    import jax

    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ConfigErrors(errors)
    check_workdir(workdir)
    runtime.enable_compilation_cache(
        config.compilation_cache_dir,
        workdir,
        min_compile_seconds=config.compilation_cache_min_seconds,
    )
    return run_job(config, workdir)


def _stopped_line(mode: str, result: object, workdir: str) -> str | None:
    """The line printed after a job that a signal stopped (None: it was not stopped)."""
    from dpojax.jobs import stop_summary

    return stop_summary(mode, result, workdir)


def _load_config():
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


def _run_reporting(config) -> None:
    """Runs the job and maps every failure to one line and its exit code."""
    try:
        _run_and_report(config)
    except ConfigErrors as e:
        for line in e.errors:
            _print_error(line)
        _exit(EXIT_CONFIG)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its line and exit code
        code = _exit_code(e)
        if FLAGS.verbose or code is None:
            if not _label():
                raise
            traceback.print_exc()  # then exit at once: see _exit
            _fail(f"{type(e).__name__}: {_one_line(e)[:500]}", code or 1)
        _fail(_message(e, code), code)


def _exit_code(e: Exception) -> int | None:
    """The exit code of an expected failure; None for anything else (a traceback)."""
    from dpojax.customizer.client.errors import CustomizerError
    from dpojax.data.problems import DataError
    from dpojax.jobs.hub_push import PushError
    from dpojax.jobs.plan import PlanError
    from dpojax.jobs.train import NonFiniteError
    from dpojax.jobs.workdir import ConfigChanged
    from dpojax.models import CheckpointError
    from dpojax.runtime import DistributedError
    from dpojax.train.tracking import TrackerError

    if isinstance(e, CustomizerError):
        return e.exit_code
    if isinstance(e, ConfigChanged | PlanError | TrackerError):  # config problems: a changed
        return EXIT_CONFIG  # resumed config, a plan the target cannot hold, an unusable tracker
    if isinstance(e, PushError):  # the run and its export are complete
        return EXIT_PUSH
    if isinstance(e, NonFiniteError):
        return EXIT_NONFINITE
    if isinstance(e, DistributedError):
        return EXIT_DISTRIBUTED
    if io_error(e) is not None:
        return EXIT_IO
    if _label() and _is_jax_runtime_error(e):
        return EXIT_DISTRIBUTED
    if isinstance(e, DataError | CheckpointError | OSError | ValueError):
        return EXIT_DATA
    return None


def _is_jax_runtime_error(e: Exception) -> bool:
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError)


def _message(e: Exception, code: int) -> str:
    """The one line that says what failed and how to go on."""
    from dpojax.data.problems import DataError

    if code == EXIT_IO:
        return io_message(io_error(e), FLAGS.workdir)
    if code == EXIT_DISTRIBUTED and _is_jax_runtime_error(e):
        return (
            f"an operation across the processes failed ({_one_line(e)[:300]}): another process "
            "has probably stopped or crashed (see its log). Every process stops; restart all of "
            "them with the same command to resume from the workdir's last checkpoint"
        )
    if code == EXIT_DATA and not isinstance(e, DataError):
        return _one_line(e)
    return str(e)


def main(argv: list[str]) -> None:
    from dpojax.interrupts import Interrupted, StopSignals

    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; options are --config, --workdir, --verbose", 2)
    logging.basicConfig(
        level=logging.DEBUG if FLAGS.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("absl", "jax._src", "orbax", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
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
        _quiet_teardown()
        print(
            f"dpojax: stopped by {e.signal_name} before the job had anything to save; rerun "
            "the same command to start it again",
            file=sys.stderr,
        )
        _exit(EXIT_OK)


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


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad --config override or recipe reported on one line."""
    try:
        return FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - absl/ml_collections raise many types here
        if "--verbose" in argv:
            raise
        text = _one_line(e)
        line = _override_hint(argv, text) or f"bad command line or config: {text}"
        print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def cli() -> None:
    from dpojax import xla_env

    xla_env.reexec_with_hugepage_malloc()  # once: the restarted process finds the tunable set
    xla_env.apply_cpu_flags()  # before JAX creates its backends
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
