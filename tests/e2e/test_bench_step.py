"""scripts/bench_step.py (the scripts/bench package): its work counting, and one tiny end-to-end run (dpojax, and TRL's
DPOTrainer when trl is installed) whose JSON line carries the contract keys and log-probs that agree
between the two frameworks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "bench_step.py"


@pytest.fixture(scope="module")
def bench():
    """scripts/bench/synthetic.py, imported as the scripts import it (scripts/ on sys.path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPTS))
        yield importlib.import_module("bench.synthetic")


def test_sequence_work_counts_tokens_causal_pairs_and_scored_tokens(bench):
    # BOS + 3 prompt words; chosen 2 words + EOS, rejected 1 word + EOS
    pair = dict(prompt=[4, 5, 6], chosen=[7, 8], rejected=[9], turn=0)
    chosen, rejected, prompt_len = bench.expected_sequences(pair)
    assert chosen == [bench.BOS_ID, 4, 5, 6, 7, 8, bench.EOS_ID]
    assert rejected == [bench.BOS_ID, 4, 5, 6, 9, bench.EOS_ID]
    assert prompt_len == 4
    tokens, attention, scored = bench.sequence_work([pair])
    assert tokens == 7 + 6
    assert attention == 7 * 8 // 2 + 6 * 7 // 2
    assert scored == 3 + 2


def test_tiny_run_prints_the_contract_json(tmp_path):
    with_trl = all(importlib.util.find_spec(m) for m in ("torch", "trl"))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, not the test session's fake eight
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--data", "dense", "--warmup", "1",
        "--steps", "2", "--pairs-per-step", "2", "--workdir", str(tmp_path),
        "--frameworks", "dpojax,trl" if with_trl else "dpojax",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["model"] == "tiny" and summary["layout"] == "prefix_shared"
    assert summary["dpojax_recompiles_in_timed_steps"] == 0
    # the compiled step alone, and the time outside it (synchronous and pipelined steps). The two are
    # timed in separate passes, so on a loaded host either can come out above the other: their order is
    # not checked here; tests/unit/scripts/test_bench_device_seconds.py checks the figure is per step.
    assert summary["dpojax_device_s_per_step"] > 0
    assert summary["dpojax_pipelined_s_per_step"] > 0
    assert summary["dpojax_outside_s_per_step"] == pytest.approx(
        summary["dpojax_s_per_step"] - summary["dpojax_device_s_per_step"]
    )
    # the host's part timed directly: batch building inside a synchronous step, and the pipelined
    # loop's wait for its next batch, each a fraction of its step
    assert 0 < summary["dpojax_host_batch_s_per_step_median"] < summary["dpojax_s_per_step"]
    assert summary["dpojax_pipelined_input_wait_s_per_step_median"] >= 0
    assert len(summary["dpojax_pipelined_step_times"]) == 2
    assert summary["dpojax_tokens_per_s"] > 0 and summary["matmul_peak_gflops"] > 0
    # 2 pairs of (64-token prompt + 64-token completion) x 2 sequences
    assert summary["sequence_tokens_per_step"] == 2 * 2 * 128
    # the FLOP model against the measured peak: a utilisation above 1 would mean it over-counts
    assert 0 < summary["mfu"] < 1.0
    if with_trl:
        assert summary["ratio"] > 0 and summary["trl_tokens_per_s"] > 0
        # the same weights and token ids: per-sequence log-probs agree to float32 summation error
        assert summary["logps_max_rel_diff"] < 2e-6, summary["logps_max_abs_diff"]
        assert summary["logps_max_abs_diff"] < 1e-3
    assert (tmp_path / "result_dpojax.json").exists()
