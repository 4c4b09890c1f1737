"""Errors and exit codes: one table for every mode, and the one line each failure prints.

Every expected failure is a `DpojaxError` whose class says its exit code (`exit_code`); the
command line (`dpojax.main`) prints `exit_line(e, workdir)` and exits with `exit_code_of(e)`.
A code means the same in every mode (`EXITS`, the table README.md#exit-codes shows; a test
keeps the two equal). The Customizer submission's own outcomes have codes of their own, 10-15:
earlier builds of 0.1.0 used 3-8 in mode `submit`, where 3-8 meant other things than in the other
modes (docs/customizer.md#exit-codes).

Failures that libraries raise are classified here too: an OSError that means "the workdir cannot
be written" (found through causes, contexts and the text of errors re-raised from other
threads or by the checkpoint library) is `EXIT_IO`; in a multi-process run a JAX runtime error
is a lost process (`EXIT_DISTRIBUTED`); other ValueErrors and OSErrors are bad data.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import os
import re


@dataclasses.dataclass(frozen=True)
class Exit:
    """One exit code: its name, what it means and what to do."""

    code: int
    name: str
    meaning: str
    remedy: str


EXITS = (
    Exit(0, "OK", "done, or stopped cleanly by SIGTERM / SIGINT", "after a stop: rerun"),
    Exit(1, "FAILED", "an unexpected error (a traceback)", "report it"),
    Exit(2, "CONFIG", "bad config, command line or settings", "fix the key named"),
    Exit(3, "DATA", "bad data, model files or checkpoint", "fix the file named"),
    Exit(4, "NONFINITE", "non-finite loss, gradients or update", "see the cause named, or skip"),
    Exit(5, "DISTRIBUTED", "the processes lost each other, or a step hung", "restart all"),
    Exit(6, "PUSH", "the push to the Hub failed (run and export complete)", "push again"),
    Exit(10, "SUBMIT_JOB_FAILED", "submit: the job ran and failed on the service", "see why"),
    Exit(11, "SUBMIT_UNREACHABLE", "submit: the service could not be reached", "retry later"),
    Exit(12, "SUBMIT_REJECTED", "submit: the service refused a request (4xx)", "fix it"),
    Exit(13, "SUBMIT_CANCELLED", "submit: the job was cancelled on the service", "resubmit"),
    Exit(14, "SUBMIT_TIMEOUT", "submit: training_timeout_seconds ran out", "raise it"),
    Exit(15, "SUBMIT_DEPLOYMENT", "submit: trained, but the deployment failed", "redeploy"),
    Exit(74, "IO", "the workdir cannot be written (sysexits' EX_IOERR)", "fix the disk"),
    Exit(130, "INTERRUPTED", "submit: interrupted by Ctrl-C or SIGTERM", "rerun"),
)
BY_NAME = {e.name: e.code for e in EXITS}
EXIT_OK = BY_NAME["OK"]
EXIT_FAILED = BY_NAME["FAILED"]
EXIT_CONFIG = BY_NAME["CONFIG"]
EXIT_DATA = BY_NAME["DATA"]
EXIT_NONFINITE = BY_NAME["NONFINITE"]
EXIT_DISTRIBUTED = BY_NAME["DISTRIBUTED"]
EXIT_PUSH = BY_NAME["PUSH"]
EXIT_SUBMIT_JOB_FAILED = BY_NAME["SUBMIT_JOB_FAILED"]
EXIT_SUBMIT_UNREACHABLE = BY_NAME["SUBMIT_UNREACHABLE"]
EXIT_SUBMIT_REJECTED = BY_NAME["SUBMIT_REJECTED"]
EXIT_SUBMIT_CANCELLED = BY_NAME["SUBMIT_CANCELLED"]
EXIT_SUBMIT_TIMEOUT = BY_NAME["SUBMIT_TIMEOUT"]
EXIT_SUBMIT_DEPLOYMENT = BY_NAME["SUBMIT_DEPLOYMENT"]
EXIT_IO = BY_NAME["IO"]
EXIT_INTERRUPTED = BY_NAME["INTERRUPTED"]


class DpojaxError(Exception):
    """Base of every expected failure; the class's `exit_code` is the process's exit code."""

    exit_code: int = EXIT_FAILED
    # The message may span lines (a list of bad records); others are printed on one line.
    multi_line: bool = False


class ConfigProblem(DpojaxError, ValueError):
    """A config, command-line or settings problem (exit 2)."""

    exit_code = EXIT_CONFIG


class InputProblem(DpojaxError, ValueError):
    """Data, model files or a checkpoint that cannot be used (exit 3)."""

    exit_code = EXIT_DATA


class WorkdirGone(DpojaxError):
    """The workdir was deleted while the run was writing it (exit 74)."""

    exit_code = EXIT_IO


class ConfigErrors(ConfigProblem):
    """Every problem `dpojax.config.validate` found, one line each (`errors`)."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


# errno values that mean "the workdir cannot be written" (EXIT_IO), with the fix.
IO_ERRNOS = {
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
    errno.ENAMETOOLONG: "a name in the path is longer than its file system allows: choose a "
    "shorter --workdir",
}
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"]+)(?:: '([^']+)')?")
# How the checkpoint library (tensorstore) words an OS error: `... file "PATH" ... [os_error_code='28']`.
_TENSORSTORE_TEXT = re.compile(r'file "([^"]+)".*?\[os_error_code=.?(\d+)')
# How a Rust library (safetensors) words one: `I/O error: No space left on device (os error 28)`.
_RUST_TEXT = re.compile(r"\(os error (\d+)\)")


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


def one_line(e: BaseException | str) -> str:
    """The message of `e` on one line, with its quotes balanced."""
    return " ".join(_unquote(str(e)).split())


def io_error(e: BaseException) -> OSError | None:
    """The OSError behind `e` that means "cannot write" (searched through causes and contexts,
    and in the text of errors re-raised from other threads), or None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in IO_ERRNOS:
            return e
        text = str(e)
        match = _ERRNO_TEXT.search(text)
        if match and int(match.group(1)) in IO_ERRNOS:
            return OSError(int(match.group(1)), match.group(2).strip(), match.group(3))
        match = _TENSORSTORE_TEXT.search(text)
        if match and int(match.group(2)) in IO_ERRNOS:
            code = int(match.group(2))
            return OSError(code, os.strerror(code), match.group(1))
        match = _RUST_TEXT.search(text)
        if match and int(match.group(1)) in IO_ERRNOS:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def io_message(err: OSError, workdir: str | os.PathLike) -> str:
    """One line: the path, what went wrong and the fix."""
    path = err.filename or workdir
    reason = err.strerror or os.strerror(err.errno or 0)
    return f"cannot write {path}: {reason}; {IO_ERRNOS.get(err.errno, 'check the workdir')}"


def _is_jax_runtime_error(e: BaseException) -> bool:
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError)


def interruption_in(e: BaseException) -> KeyboardInterrupt | None:
    """The interruption (a stop signal's `Interrupted`, Ctrl-C) among `e` and its causes, if any.
    A library may wrap one into its own error, and CPython turns one that a signal handler raised
    inside a call from C code into a SystemError ("returned a result with an exception set")
    whose cause it is; either way the failure is the stop request."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def exit_code_of(e: BaseException, *, multi_process: bool = False) -> int | None:
    """The exit code of an expected failure; None for anything else (a traceback)."""
    code = e.exit_code if isinstance(e, DpojaxError) else None
    if code is not None and code != EXIT_DATA:
        return code
    if io_error(e) is not None:  # a data error caused by a full disk is the disk's
        return EXIT_IO
    if multi_process and _is_jax_runtime_error(e):
        return EXIT_DISTRIBUTED
    if code is not None or isinstance(e, OSError | ValueError):
        return EXIT_DATA
    return None


def exit_line(e: BaseException, code: int, workdir: str | os.PathLike) -> str:
    """The one line that says what failed and how to go on."""
    if code == EXIT_IO:
        err = io_error(e)
        return io_message(err, workdir) if err is not None else one_line(e)
    if code == EXIT_DISTRIBUTED and _is_jax_runtime_error(e):
        return (
            f"an operation across the processes failed ({one_line(e)[:300]}): another process "
            "has probably stopped or crashed (see its log). Every process stops; restart all of "
            "them with the same command to resume from the workdir's last checkpoint"
        )
    if code == EXIT_DATA and not getattr(e, "multi_line", False):
        return one_line(e)
    return str(e)
