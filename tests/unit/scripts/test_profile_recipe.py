"""scripts/profile_recipe.py (a profiled run of a recipe on random weights) and
scripts/check_gpu_attention.py: the trace's device-activity count, and each script end to end on
the CPU at toy size."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from tests.helpers.repo_files import REPO_ROOT as REPO
from tests.helpers.repo_files import load_file


def test_device_activity_is_the_union_of_the_device_timelines(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    spans = [(1, 0, 10), (1, 5, 20), (1, 30, 40), (1, 40, 50), (1, 90, 100), (2, 0, 1000)]
    events = meta + [
        {"ph": "X", "pid": pid, "tid": 7, "ts": start, "dur": end - start}
        for pid, start, end in spans
    ]
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = load_file("scripts/profile_recipe.py").device_activity(trace)
    # busy [0, 20] + [30, 50] + [90, 100] = 50 us of 100 (the host's events do not count)
    assert got == {
        "span_ms": 0.1,
        "busy_ms": 0.05,
        "busy_fraction": 0.5,
        "idle_gaps": 2,
        "longest_gaps_ms": [0.04, 0.01],
    }
    host_only = tmp_path / "h.trace.json.gz"
    with gzip.open(host_only, "wt") as f:
        json.dump({"traceEvents": meta[1:] + events[-1:]}, f)
    assert load_file("scripts/profile_recipe.py").device_activity(host_only) is None


def _last_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_profile_recipe_runs_the_recipe_and_reports_its_timing(tmp_path):
    script = str(REPO / "scripts" / "profile_recipe.py")
    args = ["--out", str(tmp_path), "--shrink", "--seq", "64", "--batch", "8", "--steps", "4"]
    got = _last_json([sys.executable, script, *args, "--profile", "2:3"])
    timing = got["timing"]
    assert got["steps"] == 4 and timing["timed_steps"] == 3
    assert timing["step_seconds_median"] > 0 and timing["input_wait_seconds"] >= 0
    assert got["traces"] and got["traces"][0].endswith(".trace.json.gz")
    assert got["device_activity"] is None  # a CPU trace has no device timeline
    assert 0 < got["peak_rss_gib_sampled"] < 8
    # a second run over the same assets, without the profiler or the prefetch thread
    again = _last_json(
        [sys.executable, script, *args, "--reuse", "--run-name", "b", "--profile", "",
         "--set", "train.prefetch_steps=0"]
    )  # fmt: skip
    assert again["traces"] == [] and (tmp_path / "b" / "summary.json").is_file()


@pytest.mark.slow
def test_check_gpu_attention_compares_with_float32_reference_on_cpu():
    script = str(REPO / "scripts" / "check_gpu_attention.py")
    got = _last_json([sys.executable, script, "--cpu", "--pairs", "2", "--length", "128"])
    rows = {r["attention"]: r for r in got["rows"]}
    assert set(rows) == {"reference", "flash"}
    for row in rows.values():  # bf16 against float32: about 1e-2, never NaN
        assert 1e-4 < row["logits_rel_error"] < 5e-2 and not row["nan"]
        assert row["seq_logp_max_abs_diff"] < 0.01 * row["seq_logp_ref_mean_abs"]
