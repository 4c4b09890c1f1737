"""Stop signals across nested blocks: the command line's raising block around a job's recording
one. Each signal is delivered in the main thread at a chosen point (signal.raise_signal runs the
handler before it returns), so the windows between and inside the blocks are hit every time."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from dpojax.interrupts import Interrupted, StopSignals


class _SignalOnDelete:
    """Sends `sig` from its finalizer: the handler then runs inside __del__, where Python prints
    an exception and drops it (as when the garbage collector runs a library's finalizer)."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)


@pytest.fixture
def unraisable(monkeypatch):
    """The exceptions Python drops (printed as a traceback without a hook), collected."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_a_signal_dropped_inside_a_finalizer_is_sent_again(unraisable):
    start = time.monotonic()
    with pytest.raises(Interrupted) as caught, StopSignals(interrupt=True):
        _SignalOnDelete(signal.SIGTERM)  # unreferenced: finalized at once
        time.sleep(30)  # the signal comes again and ends the wait
    assert caught.value.signal_name == "SIGTERM"
    assert time.monotonic() - start < 20
    assert unraisable == []  # and no traceback was printed
    assert sys.unraisablehook == unraisable.append  # the block put the hook back


def test_a_job_block_starts_with_the_signal_the_block_around_it_recorded():
    with StopSignals() as outer:
        signal.raise_signal(signal.SIGINT)
        with StopSignals() as job:
            assert job.received == "SIGINT"
    assert outer.received == "SIGINT"


def test_after_a_job_block_the_raising_block_around_it_only_records(unraisable):
    """The job's tail (its summary, a barrier, the exit) is not cut short by a late signal,
    whether it lands in plain code or inside a finalizer."""
    previous = signal.getsignal(signal.SIGINT)
    with StopSignals(interrupt=True) as command:
        with StopSignals() as job:
            pass
        assert job.received is None
        signal.raise_signal(signal.SIGTERM)
        _SignalOnDelete(signal.SIGINT)
        time.sleep(0.2)  # nothing was sent again
    assert command.received == "SIGINT"
    assert unraisable == []
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_signal_the_job_recorded_is_known_to_the_block_around_it():
    with StopSignals(interrupt=True) as command:
        with StopSignals() as job:
            signal.raise_signal(signal.SIGTERM)
        assert job.received == "SIGTERM"
    assert command.received == "SIGTERM"


def test_before_a_job_block_the_raising_block_still_raises():
    with pytest.raises(Interrupted), StopSignals(interrupt=True):
        signal.raise_signal(signal.SIGINT)


def test_interruptible_raises_on_entry_and_records_after():
    with StopSignals() as stop:
        with pytest.raises(Interrupted), stop.interruptible():
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # recorded only again
        assert stop.received == "SIGINT"
        with pytest.raises(Interrupted), stop.interruptible():
            pass
