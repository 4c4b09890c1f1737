"""The step loop's helpers: the background batch producer (order, look-ahead bound, errors,
closing), the profile window's parsing, the run timer's figures, and `train.auto_fit` values."""

from __future__ import annotations

import threading
import time

import pytest

from dpojax.train.fit import FitPolicy, parse_auto_fit
from dpojax.train.prefetch import Prefetcher
from dpojax.train.profile import parse_profile_steps
from dpojax.train.timing import RunTimer, report_lines


def _counter(limit=None):
    state = {"n": 0}

    def produce():
        if limit is not None and state["n"] >= limit:
            raise ValueError(f"out of data at item {state['n']}")
        state["n"] += 1
        return state["n"]

    return produce, state


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_prefetcher_returns_items_in_order(ahead):
    produce, _ = _counter()
    prefetch = Prefetcher(produce, ahead)
    try:
        assert [prefetch.get() for _ in range(6)] == [1, 2, 3, 4, 5, 6]
    finally:
        prefetch.close()


def test_prefetcher_runs_at_most_ahead_items_ahead_and_on_its_own_thread():
    threads = set()
    produce, state = _counter()

    def recorded():
        threads.add(threading.current_thread().name)
        return produce()

    prefetch = Prefetcher(recorded, 2)
    try:
        assert prefetch.get() == 1
        time.sleep(0.5)
        # one taken, two waiting in the queue, one produced and blocked on the full queue
        assert state["n"] <= 4
        assert threads == {"dpojax-prefetch"}
    finally:
        prefetch.close()
    assert not prefetch._thread.is_alive()


def test_prefetcher_raises_the_producers_error_where_its_item_would_come():
    produce, _ = _counter(limit=2)
    prefetch = Prefetcher(produce, 2)
    try:
        assert prefetch.get() == 1 and prefetch.get() == 2
        with pytest.raises(ValueError, match="out of data at item 2"):
            prefetch.get()
    finally:
        prefetch.close()


def test_prefetcher_counts_the_time_get_waits():
    def slow():
        time.sleep(0.2)
        return 1

    prefetch = Prefetcher(slow, 1)
    try:
        prefetch.get()
        assert prefetch.waited >= 0.1
    finally:
        prefetch.close()


def test_profile_steps_values():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("10:15") == (10, 15)
    assert parse_profile_steps(" 3 ") == (3, 3)
    for bad in ("15:10", "0:2", "a:b", "1:", ":3"):
        with pytest.raises(ValueError, match="first:last"):
            parse_profile_steps(bad)


def test_auto_fit_values():
    on = parse_auto_fit("on")
    assert on == parse_auto_fit("True") and on.keys == ("grad_accum", "remat", "param_dtype")
    # "on" changes only what the config leaves at its default
    assert on.may_change("grad_accum", 1) and not on.may_change("grad_accum", 2)
    assert on.may_change("remat", "none") and not on.may_change("remat", "dots")
    assert parse_auto_fit("off") == parse_auto_fit("false") == FitPolicy(False)
    assert not parse_auto_fit("off").may_change("grad_accum", 1)
    listed = parse_auto_fit("remat, grad_accum")
    assert listed.keys == ("grad_accum", "remat") and listed.explicit
    assert listed.may_change("grad_accum", 8) and not listed.may_change("param_dtype", "float32")
    with pytest.raises(ValueError, match=r"unknown: batch_size"):
        parse_auto_fit("grad_accum,batch_size")


def test_run_timer_figures(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.5, 4.0, 10.0, 11.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    timer = RunTimer(devices=2, peak_flops=100.0)
    with timer:  # enter at 0
        timer._listen("/jax/core/compile/backend_compile_duration", 0.9)
        timer.step_done(10, 400.0)  # at 1: compiled in its interval, not a timed step
        timer.step_done(20, 400.0)  # at 3: 2 s
        timer.step_done(20, 400.0)  # at 3.5: 0.5 s
        with timer.phase("checkpoint"):  # 4.0 -> 10.0
            pass
    summary = timer.summary()
    assert summary["compile_seconds"] == pytest.approx(0.9) and summary["wall_seconds"] == 11.0
    assert summary["timed_steps"] == 2
    assert summary["step_seconds_median"] == pytest.approx(1.25)
    assert summary["checkpoint_seconds"] == pytest.approx(6.0)
    # 800 FLOPs over 2.5 s on 2 devices: 160 FLOP/s per device, 1.6x a peak of 100
    assert summary["model_flops_per_second_per_device"] == pytest.approx(160.0)
    assert summary["mfu_per_device"] == pytest.approx(1.6)
    lines = report_lines(summary)
    assert lines[0] == "## Where the time went" and any("checkpoint" in x for x in lines)
