"""Stop requests from the operating system: SIGTERM (a preemption notice, `kill`) and SIGINT
(Ctrl-C).

One mechanism for every job: `StopSignals` installs handlers for the duration of a `with` block
and restores the previous ones afterwards. By default a signal is only recorded
(`stop.received` holds its name), so a loop can finish its current step, checkpoint and return.
With `interrupt=True` the handler also raises `Interrupted` (a `KeyboardInterrupt`), which ends a
blocking wait (a sleep between status polls) at once, whichever signal it was. `interruptible()`
switches a recording instance to raising for the length of a `with` block (a phase that can be
abandoned and redone, such as a collection whose results are written only at its end); a signal
recorded before the block raises on entry.

Handlers can only be installed in the main thread; elsewhere (a job thread of the local
Customizer server) the block runs unchanged and the thread's owner handles signals.

Blocks nest (the command line's raising block around a job's recording one), and a signal is never
lost between them. Python runs a handler wherever the main thread happens to be, and an exception
raised inside a finalizer (a `__del__`, a weakref callback, which the garbage collector may run
at any allocation) is printed as a traceback and dropped. So an `Interrupted` that Python drops
is not printed but its signal sent again a moment later, from another thread (again should it
land in a finalizer too); a block started inside one that recorded a signal starts with it
recorded; and once a recording block ends, the raising block around it records only: the job
that handled signals is over, and its last lines (a summary, a barrier, the exit) are not cut
short.

`Watchdog` is the opposite case: no signal comes, the work just stops moving (a collective
waiting for a process that hung, a stuck file system). It ends the process with a message and
the stack of every thread instead of letting it wait forever.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from dpojax.errors import EXIT_DISTRIBUTED

# How long after Python dropped an `Interrupted` (inside a finalizer) its signal is sent again.
RESEND_SECONDS = 0.05


class Interrupted(KeyboardInterrupt):
    """Raised by a `StopSignals(interrupt=True)` handler; `signal_name` is e.g. "SIGTERM"."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopSignals:
    """Context manager recording (and with `interrupt=True` raising on) `signals`."""

    def __init__(
        self,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        *,
        interrupt: bool = False,
    ):
        self.signals = tuple(signals)
        self.interrupt = interrupt
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._outer: StopSignals | None = None
        self._previous_hook = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                outer = getattr(self._previous[sig], "__self__", None)
                if isinstance(outer, StopSignals):
                    self._outer = outer
            if self._outer is not None and self.received is None:
                self.received = self._outer.received  # its Interrupted may have been dropped
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name
        if self.interrupt:
            raise Interrupted(self.received)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[StopSignals]:
        """Raise `Interrupted` on a signal inside the block (and on entry if one was recorded
        already); record only again after it."""
        if self.received:
            raise Interrupted(self.received)
        previous, self.interrupt = self.interrupt, True
        try:
            yield self
        finally:
            self.interrupt = previous

    def _unraisable(self, unraisable) -> None:
        """sys.unraisablehook while the block runs: an `Interrupted` raised inside a finalizer
        (Python drops it there) is not printed but sent again, to end the work it was meant
        for; anything else goes to the previous hook."""
        if isinstance(unraisable.exc_value, Interrupted):
            sig = signal.Signals[unraisable.exc_value.signal_name]
            # From another thread, a moment later: sent at once, the handler would run inside
            # this hook. Should it land in a finalizer again, it comes back again.
            resend = threading.Timer(RESEND_SECONDS, os.kill, (os.getpid(), sig))
            resend.daemon = True
            resend.start()
            return
        self._previous_hook(unraisable)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook, self._previous_hook = self._previous_hook, None
        outer, self._outer = self._outer, None
        if outer is not None and not self.interrupt:
            # The job that recorded signals is over; what remains of the run is its tail.
            outer.interrupt = False
            outer.received = outer.received or self.received


class Watchdog:
    """Context manager that ends the process when the watched work stops moving: unless `kick()`
    comes at least every `seconds`, it writes "dpojax: error: <label> no progress for ... (<what
    the last kick named>): <message>" (and, with `stacks`, every thread's stack) to stderr and
    exits with `exit_code` (os._exit: a call blocked in a collective cannot be interrupted).
    `seconds` 0: off."""

    def __init__(
        self,
        seconds: float,
        message: str,
        *,
        exit_code: int = EXIT_DISTRIBUTED,
        label: str = "",
        doing: str = "starting",
        stacks: bool = True,
    ):
        self.seconds, self.message, self.exit_code, self.label = seconds, message, exit_code, label
        self.doing, self.stacks = doing, stacks
        self._deadline = time.monotonic() + seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.seconds > 0:
            self._thread = threading.Thread(target=self._watch, name="dpojax-watchdog", daemon=True)
            self._thread.start()
        return self

    def kick(self, doing: str) -> None:
        """Progress: the deadline moves to `seconds` from now; `doing` names the work."""
        self.doing = doing
        self._deadline = time.monotonic() + self.seconds

    def _watch(self) -> None:
        while not self._stop.is_set():
            left = self._deadline - time.monotonic()
            if left <= 0:
                label = f"{self.label} " if self.label else ""
                follows = "; the stack of every thread follows" if self.stacks else ""
                sys.stderr.write(
                    f"dpojax: error: {label}no progress for {self.seconds:g} s ({self.doing}): "
                    f"{self.message}{follows}\n"
                )
                sys.stderr.flush()
                if self.stacks:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    sys.stderr.flush()
                os._exit(self.exit_code)
            self._stop.wait(min(left, 1.0))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
