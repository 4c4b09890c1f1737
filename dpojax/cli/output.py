"""The command line's output rules, in one place: a run's last line (what it wrote, or after a
signal how to go on), every failure as one line and the exit code that says what went wrong
(`dpojax.errors`), the process label of a multi-process run, the last line written after the
libraries' noise, and an exit that does not wait in JAX's shutdown barrier (`dpojax.main`)."""

from __future__ import annotations

import logging
import os
import sys
import traceback

from dpojax.errors import (
    EXIT_CONFIG,
    EXIT_OK,
    ConfigErrors,
    exit_code_of,
    exit_line,
    interruption_in,
    one_line,
)


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


def quiet_teardown(verbose: bool) -> None:
    """Without --verbose, once the job has ended: library log records are teardown noise (the
    checkpoint library's threads log errors at interpreter shutdown), so the run's last line is
    dpojax's own."""
    if not verbose:
        for name in ("absl", "orbax", "jax", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def fail(message: str, code: int) -> None:
    print_error(message)
    exit_process(code)


def _run_and_report(config, workdir: str, verbose: bool) -> None:
    """Runs the job (`dpojax.jobs.run`: validation, then the mode's job; imported here, so that
    the command sets XLA's flags before JAX is imported); then the line saying how to go on after
    a stop, or what it wrote."""
    from dpojax.jobs import outputs_line, run, stop_summary

    try:
        result = run(config, workdir)
    finally:
        quiet_teardown(verbose)
    line = stop_summary(config.mode, result, workdir)
    if line:
        print(f"dpojax: {label()}{line}", file=sys.stderr)
        exit_process(EXIT_OK, at_once=True)
    print(f"dpojax: {label()}{outputs_line(config.mode, result, workdir)}", file=sys.stderr)


def run_reporting(config, workdir: str, verbose: bool) -> None:
    """Runs the job and maps every failure to one line and its exit code (with `verbose`, or
    for an error no class covers, the traceback too)."""
    try:
        _run_and_report(config, workdir, verbose)
    except ConfigErrors as e:
        for line in e.errors:
            print_error(line)
        exit_process(EXIT_CONFIG)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its line and exit code
        code = exit_code_of(e, multi_process=bool(label()))
        interrupted = interruption_in(e) if code is None else None
        if interrupted is not None:  # an unexpected error a stop signal caused: the stop (main)
            raise interrupted from None
        if verbose or code is None:
            if not label():
                raise
            traceback.print_exc()  # then exit at once: see exit_process
            fail(f"{type(e).__name__}: {one_line(e)[:500]}", code or 1)
        fail(exit_line(e, code, workdir), code)


def stopped_before_the_job(signal_name: str, verbose: bool) -> None:
    """The stop line of a signal that came before the job had anything to save (the recipe
    loading, start-up, a job with nothing to keep), then exit 0."""
    quiet_teardown(verbose)
    print_last(
        f"dpojax: stopped by {signal_name} before the job had anything to save; rerun "
        "the same command to start it again"
    )
    exit_process(EXIT_OK, at_once=True)
