"""A gs:// workdir end to end against a GCS emulator on 127.0.0.1: train, interrupted by SIGTERM
after its first checkpoint reached the bucket, resumed on another machine (an empty local
cache), then exported from the workdir URL alone; the bucket holds each step's outputs. The
checkpoints are orbax's own in the bucket (its GCS layout, commit markers included) and never
in a local mirror."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.e2e.test_cli import ROOT, _data, assets  # noqa: F401 - the fixture
from tests.e2e.test_cli_faults import FAST, Run
from tests.helpers.gcs_emulator import gcs_bucket  # noqa: F401 - the fixture

TRAIN = ["--config.train.steps=40", "--config.train.eval_every=0"]
TRAIN += ["--config.checkpoint.every_steps=5", "--config.train.report_plots=False"]


def _names(emulator, folder: str) -> set[str]:
    root = f"{emulator.bucket}/{folder}"
    emulator.fs.invalidate_cache()
    return {name[len(root) + 1 :] for name in emulator.fs.find(root)}


def _mirror(cache, emulator):
    """The local mirror of gs://bucket/runs/tiny under the cache `cache`."""
    return cache / "workdirs" / "gs" / emulator.bucket / "runs" / "tiny"


def test_a_gs_workdir_trains_resumes_after_sigterm_and_exports(assets, gcs_bucket, tmp_path):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/runs/tiny"
    # Without GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: dpojax sets it where an emulator is named
    # (gcsfs would otherwise wait 60 s per bucket for a gRPC layout lookup, warning each time).
    env = {k: v for k, v in gcs_bucket.env.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    env["DPOJAX_CACHE"] = str(tmp_path / "machine1")
    # 1. Train; SIGTERM once a committed checkpoint is in the bucket.
    run = Run(url, *_data(assets), *TRAIN, env_extra=env)

    def checkpoint_in_bucket() -> bool:
        return any(n.endswith("commit_success.txt") for n in _names(gcs_bucket, "runs/tiny"))

    assert run.wait_for(checkpoint_in_bucket), "\n".join(run.lines[-20:])
    run.interrupt(signal.SIGTERM, jitter=(0.0, 0.1))
    code, last = run.finish()
    assert code == 0 and "stopped by SIGTERM" in last, "\n".join(run.lines[-20:])
    assert f"{url}/checkpoints" in last and "rerun the same command" in last
    stopped = gcs_bucket.files("runs/tiny")
    assert json.loads(stopped["summary.json"])["status"] == "stopped by SIGTERM"
    assert "config.json" in stopped and "metrics.jsonl" in stopped
    assert not any("orbax-checkpoint-tmp" in name for name in stopped)
    done_steps = len(stopped["metrics.jsonl"].splitlines())
    assert 5 <= done_steps < 40
    saved = {n.split("/")[1] for n in stopped if n.endswith("/commit_success.txt")}
    assert saved and all(f"checkpoints/{s}/state/_METADATA" in stopped for s in saved)
    mirror1 = _mirror(tmp_path / "machine1", gcs_bucket)
    assert (mirror1 / "metrics.jsonl").is_file() and not (mirror1 / "checkpoints").exists()

    # 2. Resume on another machine: only the bucket carries the run over.
    env["DPOJAX_CACHE"] = str(tmp_path / "machine2")
    run = Run(url, *_data(assets), *TRAIN, env_extra=env)
    code, last = run.finish()
    assert code == 0, "\n".join(run.lines[-20:])
    assert f"wrote {url}/checkpoints, {url}/metrics.jsonl" in last, last
    resumed = [x for x in run.lines if f"resumed from {url}/checkpoints at step" in x]
    assert resumed, "\n".join(run.lines[-20:])
    assert not (_mirror(tmp_path / "machine2", gcs_bucket) / "checkpoints").exists()
    storage = [x for x in run.lines if "gcsfs" in x or "fsspec" in x or "Handshake" in x]
    assert len(storage) <= 2, "\n".join(storage[:10])  # a summary line per kind, at most
    files = gcs_bucket.files("runs/tiny")
    logged = [json.loads(x) for x in files["metrics.jsonl"].splitlines()]
    assert [x["step"] for x in logged if x["split"] == "train"] == list(range(1, 41))
    assert json.loads(files["summary.json"])["status"] == "completed"
    assert {"report.md", "export/model.safetensors", "export/config.json"} <= files.keys()
    steps = {n.split("/")[1] for n in files if n.startswith("checkpoints/")}
    assert "40" in steps and "5" not in steps  # max_to_keep's pruning reached the bucket

    # 3. Export from the URL alone (its config.json read from the bucket) on a third machine.
    gcs_bucket.fs.rm(f"{gcs_bucket.bucket}/runs/tiny/export", recursive=True)
    env["DPOJAX_CACHE"] = str(tmp_path / "machine3")
    cmd = [sys.executable, "-m", "dpojax.main", f"--workdir={url}", "--config.mode=export"]
    result = subprocess.run(
        [*cmd, *FAST],
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", DPOJAX_HUGEPAGE_MALLOC="0", **env),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].endswith(f"wrote {url}/export")
    exported = gcs_bucket.files("runs/tiny/export")
    assert exported["model.safetensors"] == files["export/model.safetensors"]
