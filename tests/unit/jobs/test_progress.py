"""Progress away from a terminal: a plain line at the first step, then at most one per interval,
and one at the last step, with human units; nothing when disabled."""

from __future__ import annotations

import io
import sys

import pytest

from dpojax.jobs.train.progress import Progress, duration, interactive, rate

METRICS = {"loss": 0.693147, "rewards/accuracies": 0.625, "tokens_per_s": 1234.0}


@pytest.fixture(autouse=True)
def _no_notebook(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_at_the_first_step_every_interval_and_the_last():
    out, clock = io.StringIO(), _Clock()
    progress = Progress(True, 0, 10, stream=out, every_seconds=30.0, clock=clock)
    assert progress.bar is None and progress.plain  # StringIO is no terminal
    for step in range(1, 11):
        clock.now = 100.0 + 10.0 * step  # 10 s a step
        progress.update(METRICS)
    lines = out.getvalue().splitlines()
    # step 1 (first), step 4 (30 s after step 1), step 7, step 10 (30 s later and the last)
    assert [line.split(",")[0] for line in lines] == [
        "train: step 1 of 10 (10%)",
        "train: step 4 of 10 (40%)",
        "train: step 7 of 10 (70%)",
        "train: step 10 of 10 (100%)",
    ]
    assert lines[0] == (
        "train: step 1 of 10 (10%), loss 0.6931, accuracy 0.625, 1.2k tokens/s, "
        "10s with compiling, ETA after the next step"
    )
    assert lines[1].endswith(", 40s, ETA 1m00s")  # 6 steps left at 10 s each
    assert lines[-1].endswith(", 1m40s, ETA 0s")


def test_the_estimate_leaves_out_the_first_step_and_its_compile():
    """Before: a first step of 3000 s (the compile) and 1 s steps after it estimated 50 min for
    the last 6 of 10 steps."""
    out, clock = io.StringIO(), _Clock()
    progress = Progress(True, 0, 10, stream=out, every_seconds=0.0, clock=clock)
    clock.now += 3000.0
    progress.update(METRICS)
    for _ in range(3):
        clock.now += 1.0
        progress.update(METRICS)
    assert out.getvalue().splitlines()[-1].endswith(", 50m03s, ETA 6s")


def test_resumed_run_counts_from_its_step_and_estimates_from_its_own_pace():
    out, clock = io.StringIO(), _Clock()
    progress = Progress(True, 50, 100, stream=out, every_seconds=0.0, clock=clock)
    clock.now += 40.0  # the first step of this process: it compiles
    progress.update(METRICS)
    assert out.getvalue().startswith("train: step 51 of 100 (51%)")
    clock.now += 4.0
    progress.update(METRICS)
    assert out.getvalue().rstrip().endswith("44s, ETA 3m12s")  # 48 steps left at 4 s each


def test_a_one_step_run_says_it_is_done():
    out, clock = io.StringIO(), _Clock()
    progress = Progress(True, 0, 1, stream=out, clock=clock)
    clock.now += 5.0
    progress.update(METRICS)
    assert out.getvalue().rstrip().endswith(", 5s, ETA 0s")


def test_the_bar_restarts_its_clock_after_the_first_step(monkeypatch):
    """In a terminal or notebook: tqdm's own rate and estimate count from the end of the first
    step, which held the compile."""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    progress = Progress(True, 0, 10, stream=Tty())
    began = progress.bar.start_t
    monkeypatch.setattr(progress.bar, "_time", lambda: began + 3000.0)
    progress.update(METRICS)
    assert (progress.bar.n, progress.bar.initial) == (1, 1)
    assert progress.bar.start_t == began + 3000.0
    progress.update(METRICS)
    assert progress.bar.n == 2
    progress.close()


def test_disabled_prints_nothing():
    out = io.StringIO()
    progress = Progress(False, 0, 3, stream=out)
    for _ in range(3):
        progress.update(METRICS)
    progress.close()
    assert out.getvalue() == ""


def test_units():
    assert [duration(s) for s in (0.4, 59, 60, 130, 3599, 3600, 3900)] == [
        "0s",
        "59s",
        "1m00s",
        "2m10s",
        "59m59s",
        "1h00m",
        "1h05m",
    ]
    assert [rate(v) for v in (950, 1234, 3.4e6)] == ["950", "1.2k", "3.4M"]


def test_a_terminal_is_interactive():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert interactive(Tty())
    assert not interactive(io.StringIO())
