"""End to end: a training run whose step does not fit a small memory budget
(train.usable_memory_gib) takes more micro-batches before loading its data, says so in one line
and in summary.json, and completes; the same run traces steps 2 to 3 with the JAX profiler
(train.profile_steps) and says in summary.json and report.md where its time went. A budget
nothing fits is refused before any pair is tokenized."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny_test.py"


def _cli(workdir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dpojax.main", f"--config={RECIPE}", f"--workdir={workdir}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run(
        [*cmd, *overrides], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600
    )


def test_auto_fit_profile_and_timing(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model", "llama", seed=0)
    pairs = [
        PreferencePair(prompt=f"q{i}?", chosen=f" yes {i}", rejected=f" no {i}", metadata={})
        for i in range(16)
    ]
    write_pairs(pairs, tmp_path / "train.jsonl", format="trl")
    data = [f"--config.model.path={model}", f"--config.data.train_path={tmp_path / 'train.jsonl'}"]
    # what the recipe's step needs on this host's CPU (the plan of the same compile)
    probe = _cli(tmp_path / "probe", *data, "--config.mode=plan")
    assert probe.returncode == 0, probe.stderr[-3000:]
    plan = json.loads((tmp_path / "probe" / "plan.json").read_text())
    memory = plan["candidates"][0]["train"]["memory_bytes"]
    need = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    budget = 0.97 * need / 2**30  # the recipe does not fit; 2 micro-batches do
    work = tmp_path / "run"
    proc = _cli(
        work,
        *data,
        f"--config.train.usable_memory_gib={budget}",
        "--config.train.profile_steps=2:3",
        "--config.export.enabled=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto-fit: train.grad_accum 1 -> 2, because the recipe's step needs" in proc.stderr
    summary = json.loads((work / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["auto_fit"]["changed"] == {"train.grad_accum": [1, 2]}
    timing = summary["timing"]
    assert timing["compile_seconds"] > 0 and timing["timed_steps"] >= 1
    assert timing["step_seconds_median"] > 0 and timing["tokens_per_second"] > 0
    assert timing["checkpoint_seconds"] > 0 and timing["evaluation_seconds"] == 0
    assert timing["input_wait_seconds"] >= 0 and timing["mfu_per_device"] is None  # a CPU
    assert "## Where the time went" in (work / "report.md").read_text()
    traces = list((work / "profile").rglob("*.xplane.pb"))
    assert traces, sorted((work / "profile").rglob("*"))
    # nothing fits 1 MiB: refused before any pair is tokenized (the remat and parameter dtype
    # the config sets are kept, so only the micro-batches are tried)
    proc = _cli(
        tmp_path / "refused",
        *data,
        "--config.train.usable_memory_gib=0.001",
        "--config.model.remat=full",
        "--config.model.param_dtype=bfloat16",
    )
    assert proc.returncode != 0
    assert "the train step needs" in proc.stderr and "lower data.max_length" in proc.stderr
    assert not (tmp_path / "refused" / "token_cache").exists()
