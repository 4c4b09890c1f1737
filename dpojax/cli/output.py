"""The command line's output: one line per error, the process label of a multi-process run,
the run's last line written after the libraries' noise, and an exit that does not wait in JAX's
shutdown barrier (`dpojax.main`)."""

from __future__ import annotations

import logging
import os
import sys

from dpojax.errors import one_line


class OneLineLibraryLogs(logging.Filter):
    """Without --verbose, a library's log record keeps its first line: no tracebacks from
    background threads (a checkpoint save failing on a full disk logged hundreds of lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("dpojax") and (record.exc_info or "\n" in str(record.msg)):
            record.msg = (record.getMessage().splitlines() or [""])[0]
            record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        return True


def quiet_excepthook(seen: set[str]):
    """Without --verbose, an exception that reaches the top of a thread or a library callback
    prints one line, once (after a failed checkpoint save, the library's callbacks raised the
    same error dozens of times)."""

    def hook(kind, value, tb) -> None:
        line = one_line(f"{kind.__name__}: {value}")
        if line not in seen:
            seen.add(line)
            print(f"dpojax: {line}", file=sys.stderr)

    return hook


def print_last(line: str) -> None:
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


def label() -> str:
    from dpojax.runtime import process_label

    label = process_label()
    return f"{label} " if label else ""


def print_error(message: str) -> None:
    print(f"dpojax: error: {label()}{message}", file=sys.stderr)


def exit_process(code: int, *, at_once: bool = False) -> None:
    """sys.exit, or os._exit once the output is flushed: in a multi-process run (JAX's shutdown
    barrier would otherwise wait for processes that may be gone) and, with `at_once`, after a
    stop, when the job has closed all it writes: the interpreter's teardown would only add the
    libraries' noise after the stop line (the checkpoint library's threads print "Event loop is
    closed") or race XLA's compile threads."""
    if not (at_once or label()):
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
