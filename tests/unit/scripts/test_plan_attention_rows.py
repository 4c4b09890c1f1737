"""scripts/plan_attention_rows.py: the rows it prints from a plan.json (--summarize)."""

from __future__ import annotations

import json
import sys

from tests.helpers.repo_files import load_file


def _script():
    return load_file("scripts/plan_attention_rows.py")


def _report() -> dict:
    step = {"hlo_bytes": 3e9, "temp_bytes": 2**29, "fits": True}
    return {
        "target": "tpu:v5e:2x2",
        "candidates": [
            {
                "label": "recipe",
                "attention": "pallas",
                "fits": True,
                "train": {"total_bytes": 6 * 2**30, "memory_bytes": {"temp": 2**31}},
                "roofline": {"step_seconds_bound": 0.5, "bound_by": "memory"},
            }
        ],
        "attention_implementations": [
            {
                "implementation": "pallas",
                "runs": True,
                "block": 256,
                "per_step": step,
                "share": {"hlo_bytes": 0.25, "flops": 0.1, "model_flops": 0.125},
            },
            {
                "implementation": "reference",
                "runs": True,
                "block": None,
                "per_step": dict(step, fits=False, hlo_bytes=None),
                "share": {"hlo_bytes": None, "flops": None, "model_flops": 0.125},
            },
            {"implementation": "cudnn", "runs": False, "reason": "needs a GPU"},
        ],
    }


def test_rows_from_a_plan(tmp_path, monkeypatch, capsys):
    plan_dir = tmp_path / "tpu_v5e_2x2_2048"
    plan_dir.mkdir()
    (plan_dir / "plan.json").write_text(json.dumps(_report()))
    args = ["--config=c.py", "--target=tpu:v5e:2x2", "--lengths=2048,8192", "--pairs=4"]
    monkeypatch.setattr(sys, "argv", ["x", *args, f"--workdir={tmp_path}", "--summarize"])
    _script().main()
    lines = capsys.readouterr().out.splitlines()
    step = "| tpu:v5e:2x2 | 2,048 | yes | 6.00 | 2.00 | 0.500 (memory) | "
    assert lines[2] == step + "pallas (the step's) | 256 | 0.50 | 3.0 | 25.0% | 10.0% / 12.5% |"
    assert lines[3] == step + "reference | - | 0.50 (out of memory) | - | n/a | n/a / 12.5% |"
    assert lines[4] == step + "cudnn | - | does not run: needs a GPU | | | |"
    assert lines[5].startswith("| tpu:v5e:2x2 | 8,192 | no plan.json |")
    assert lines[1].count("---") == lines[0].count(" | ") + 1
