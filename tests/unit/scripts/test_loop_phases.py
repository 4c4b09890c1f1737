"""scripts/loop_phases.py: the per-phase breakdown of a loop's rounds and its gate line."""

from __future__ import annotations

import json

from tests.helpers.repo_files import load_file


def _script():
    return load_file("scripts/loop_phases.py")


def _round(r, seconds, training, evaluation, cpu):
    return {
        "round": r,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "phase_seconds": {"training": training, "evaluation": evaluation},
        "phase_cpu_seconds": {"training": 2 * training, "evaluation": evaluation},
    }


def test_breakdown_and_gate_line(tmp_path, capsys):
    summary = {
        "rounds": [{"round": 0}, _round(1, 2.0, 1.0, 0.5, 3.0), _round(2, 10.0, 6.0, 2.0, 15.0)]
        + [_round(3, 14.0, 8.0, 4.0, 21.0)],
        "rounds_done": 3,
        "wall_seconds": 30.0,
        "stop_reason": "gate_rounds",
        "best_round": 3,
        "gate": {
            "conditions": "rate>=0.95",
            "met_rounds": [2, 3],
            "first_met_round": 2,
            "first_met_seconds": 14.4,
        },
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    _script().main([str(path), "--from-round", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[2:6] == [  # means over rounds 2 and 3
        "| training | 7.00 | 58% | 14.00 |",
        "| evaluation | 3.00 | 25% | 3.00 |",
        "| other | 2.00 | 17% | |",
        "| **round** | **12.00** | 100% | **18.00** |",
    ]
    assert "3 rounds, loop wall 30 s, stop: gate_rounds, kept round 3" in out
    assert out[-1] == (
        "Gate `rate>=0.95`: first met at round 2, 14 s into the loop; met in rounds 2, 3."
    )
    assert _script().phase_table([]) == ["(no round with phase times)"]
    del summary["gate"]
    path.write_text(json.dumps(summary))
    _script().main([str(path)])
    assert capsys.readouterr().out.splitlines()[-1] == "no gate (loop.gate)"
    # a summary from before loop.gate: its rounds judged by their figures
    for r, rate in zip(summary["rounds"], (0.0, 0.5, 0.96, 0.97), strict=True):
        r["rate"] = rate
    path.write_text(json.dumps(summary))
    _script().main([str(path), "--gate", "rate>=0.95"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Gate `rate>=0.95`: first met at round 2; met in rounds 2, 3."
    )
    (tmp_path / "loop_state.json").write_text(json.dumps({"round_started": {"2": 4.5}}))
    _script().main([str(path), "--gate", "rate>=0.95"])
    assert "first met at round 2, 14 s into the loop" in capsys.readouterr().out  # 4.5 + 10
