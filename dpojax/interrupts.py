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
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence


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

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
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

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
