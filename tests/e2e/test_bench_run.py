"""scripts/bench_run.py (scripts/bench/run.py): whole user runs, dpojax's `python -m dpojax.main` against
a TRL DPOTrainer script, each measured in its own process. Its summary arithmetic, its inputs, and one
tiny end-to-end comparison whose JSON line carries wall time, CPU time and peak RSS of both runs."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "bench_run.py"


@pytest.fixture(scope="module")
def run_module():
    """scripts/bench/run.py, imported as the script imports it (scripts/ on sys.path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPTS))
        yield importlib.import_module("bench.run")


def _run(wall, rss):
    return dict(wall_s=wall, cpu_s=wall / 2, peak_rss_gb=rss, load_before=0.0, load_after=0.0)


def test_summary_takes_the_median_run_by_wall_time_and_the_largest_rss(run_module):
    args = run_module.parse_args(["--model", "tiny", "--seq", "64", "--pairs", "8"])
    results = dict(
        dpojax=[_run(30.0, 2.0), _run(10.0, 2.5), _run(20.0, 1.5)],
        trl=[_run(40.0, 1.0)],
    )
    summary = run_module.summarize(args, results)
    assert summary["steps"] == 1  # 8 pairs, 8 a step
    assert summary["dpojax_wall_s"] == 20.0 and summary["dpojax_peak_rss_gb"] == 1.5
    assert summary["dpojax_peak_rss_gb_max"] == 2.5
    assert summary["speedup"] == pytest.approx(40.0 / 20.0)
    assert summary["rss_ratio"] == pytest.approx(1.5 / 1.0)


def test_bad_arguments_are_refused(run_module):
    with pytest.raises(SystemExit):
        run_module.parse_args(["--pairs", "4", "--batch-size", "8"])


def test_the_dpojax_command_runs_the_shipped_recipe_on_the_pairs(run_module, tmp_path):
    args = run_module.parse_args(
        ["--seq", "2048", "--pairs", "16", "--batch-size", "4", "--dpojax-override", "seed=3"]
    )
    cmd = run_module.dpojax_command(args, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "w")
    assert cmd[1:5] == ["-m", "dpojax.main", "--config", str(run_module.RECIPE)]
    for flag in (
        f"--config.model.path={tmp_path / 'm'}",
        f"--config.data.train_path={tmp_path / 'p.jsonl'}",
        "--config.data.max_length=2048",
        "--config.train.batch_size=4",
        "--config.train.steps=4",
        "--config.seed=3",
    ):
        assert flag in cmd


@pytest.mark.slow
def test_trls_gradient_checkpointing_is_explicit_and_recorded(run_module, tmp_path):
    """TRL 1.16 recomputes its layers by default; the spec passes the switch on either way and
    the summary says which was compared."""
    for flag, expected in ((None, True), ("false", False), ("true", True)):
        argv = ["--model", "tiny", "--seq", "64", "--pairs", "8"]
        if flag:
            argv += ["--trl-gradient-checkpointing", flag]
        args = run_module.parse_args(argv)
        out = tmp_path / f"trl_{flag}"
        cmd = run_module.trl_command(args, tmp_path / "m", tmp_path / "p.jsonl", out)
        spec = json.loads(Path(cmd[-1]).read_text())
        assert spec["gradient_checkpointing"] is expected
        summary = run_module.summarize(args, dict(trl=[_run(1.0, 1.0)]))
        assert summary["trl_gradient_checkpointing"] is expected


def test_tiny_whole_runs_print_the_contract_json(tmp_path):
    with_trl = all(importlib.util.find_spec(m) for m in ("torch", "trl", "datasets"))
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--seq", "64", "--pairs", "4",
        "--batch-size", "2", "--workdir", str(tmp_path),
        "--frameworks", "dpojax,trl" if with_trl else "dpojax",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["seq"] == 64
    # every line of the pair file is one pair of 64-token sequences' text
    lines = (tmp_path / "pairs.jsonl").read_text().splitlines()
    assert len(lines) == 4 and set(json.loads(lines[0])) == {"prompt", "chosen", "rejected"}
    run = json.loads((tmp_path / "dpojax_run0" / "summary.json").read_text())
    assert run["status"] == "completed" and run["step"] == 2
    # the child's own peak, not the parent's: a JAX process holds more than 0.1 GB
    assert 0.1 < summary["dpojax_peak_rss_gb"] < 8 and summary["dpojax_cpu_s"] > 0
    assert summary["dpojax_wall_s"] > 0
    if with_trl:
        assert (tmp_path / "trl_run0" / "model.safetensors").exists()
        assert 0.1 < summary["trl_peak_rss_gb"] < 8
        assert summary["speedup"] > 0 and summary["rss_ratio"] > 0
