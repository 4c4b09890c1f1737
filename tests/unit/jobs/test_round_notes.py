"""Phase times (wall and CPU per phase, nested phases exclusive) and what a loop round says about
itself: greedy answers changed, the gate, where its time went."""

import time

import pytest

from dpojax.collect.gate import Gate
from dpojax.jobs import phases
from dpojax.jobs.phases import PhaseTimes, describe
from dpojax.jobs.rounds.notes import (
    AnswerLog,
    answers_changed,
    gate_note,
    gate_stop_line,
    movement_note,
    timing_line,
)


def test_phases_accumulate_and_nest_exclusively(monkeypatch):
    clock = iter(range(0, 100, 1))  # every reading of either clock advances it by 1
    monkeypatch.setattr(phases.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(phases.time, "process_time", lambda: 2.0 * next(clock))
    times = PhaseTimes(order=("outer", "unused"))
    # outer starts at wall 0, CPU 2; inner at wall 2, CPU 6 and ends at wall 4, CPU 10 (2 s wall,
    # 4 s CPU); outer ends at wall 6, CPU 14: 6 s wall and 12 s CPU, less the inner phase's.
    with times.phase("outer"), times.phase("inner"):
        pass
    with times.phase("inner"):  # wall 8 to 10, CPU 18 to 22
        pass
    assert times.wall == {"outer": 4.0, "unused": 0.0, "inner": 4.0}
    assert times.cpu == {"outer": 8.0, "unused": 0.0, "inner": 8.0}


def test_phases_measure_real_time():
    times = PhaseTimes()
    with times.phase("sleep"):
        time.sleep(0.05)
    assert times.wall["sleep"] >= 0.05 and 0 <= times.cpu["sleep"] < times.wall["sleep"]


def test_phase_moves_and_updates():
    times = PhaseTimes()
    times.add("compile", 2.0, 4.0)
    times.add("training", 6.0, 12.0)
    times.move("compile", "training", 0.25)
    assert times.wall == {"compile": 1.5, "training": 6.5}
    assert times.cpu == {"compile": 3.0, "training": 13.0}
    times.update({"export": 0.1234567}, {"export": 0.2})
    assert times.rounded() == (
        {"compile": 1.5, "training": 6.5, "export": 0.123},
        {"compile": 3.0, "training": 13.0, "export": 0.2},
    )
    assert describe({"a": 1.04, "b": 2.0}, 3.5) == "a 1.0, b 2.0, other 0.5 s"
    assert describe({"a": 1.0}) == "a 1.0 s"


def test_answer_log_and_changes():
    log = AnswerLog(lambda prompts: [str(p).upper() for p in prompts])
    assert log(["a", "b"]) == ["A", "B"]
    log([[{"role": "user", "content": "c"}]])
    assert len(log.answers) == 3 and log.answers["a"] == "A"
    previous = {"a": "A", "b": "x", "z": "Z"}
    assert answers_changed(previous, log.answers) == {"changed": 1, "compared": 2}


@pytest.mark.parametrize(
    "change, same, expected",
    [
        (None, False, "greedy answers not compared"),
        ({"changed": 0, "compared": 0}, True, ""),  # a workflow without an evaluation
        (
            {"changed": 0, "compared": 4520},
            True,
            "0 of 4520 greedy answers changed since round 1: ",
        ),
        ({"changed": 7, "compared": 4520}, True, "equally scored"),
        ({"changed": 7, "compared": 4520}, False, "7 of 4520 greedy answers changed since round 1"),
    ],
)
def test_movement_note(change, same, expected):
    note = movement_note(2, change, same, 0.6931)
    assert expected in note
    if change and change["compared"] and not change["changed"]:
        assert "(final train loss 0.6931)" in note and "every figure is round 1's" in note


def test_gate_and_timing_notes():
    gate = Gate("rate>=0.95,losses<=0")
    assert gate_note(Gate(""), {}, 0, 0) == ""
    assert gate_note(gate, {"rate": 0.96, "losses": 0}, 1, 2) == "gate met (held 1 of 2 rounds)"
    assert gate_note(gate, {"rate": 0.96, "losses": 0}, 1, 1) == "gate met"  # stops at once
    assert gate_stop_line(16, gate, 1) == (
        f"stopping after round 16: the gate ({gate}) is met (loop.gate_rounds=1)"
    )
    assert gate_stop_line(9, gate, 2) == (
        f"stopping after round 9: the gate ({gate}) has held for 2 rounds (loop.gate_rounds=2)"
    )
    assert gate_note(gate, {"rate": 0.9, "losses": 0}, 0, 2) == (
        "gate not met: rate 0.9 (needs >=0.95)"
    )
    record = {"seconds": 10.0, "phase_seconds": {"training": 7.0, "evaluation": 2.0}}
    assert timing_line(3, {**record, "cpu_seconds": 18.26}) == (
        "round 3 took 10.0 s (training 7.0, evaluation 2.0, other 1.0 s), process CPU 18.3 s"
    )
