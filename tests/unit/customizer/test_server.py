"""The local server: the dpojax backend's plumbing (with an injected fake `train_fn`;
tests/unit/customizer/test_dpojax_backend.py runs the real training loop), its refusal of unknown
configs, and the command line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dpojax.customizer.client import JobFailedError, RequestRejectedError, SubmitInterrupted, submit
from dpojax.customizer_server.backends import DpojaxBackend
from dpojax.data.pair_files import read_pairs
from tests.helpers.customizer import make_pairs, settings_for

STEPS_PER_EPOCH = 2


class FakeTrain:
    """Stands in for the dpojax training loop: reads the pairs, reports progress, writes a dir."""

    def __init__(self, step_seconds: float = 0.03, fail: str | None = None, forever: bool = False):
        self.step_seconds, self.fail, self.forever = step_seconds, fail, forever
        self.calls: list[dict] = []

    def __call__(self, model_dir, train_pairs_path, val_pairs_path, output_dir, hp, progress):
        train, _ = read_pairs(train_pairs_path, format="customizer")
        val, _ = read_pairs(val_pairs_path, format="customizer")
        self.calls.append(
            {
                "model_dir": model_dir,
                "train": len(train),
                "val": len(val),
                "hp": hp,
                "train_path": train_pairs_path,
                "output_dir": output_dir,
            }
        )
        if self.fail:
            raise RuntimeError(self.fail)
        epochs, step = hp["epochs"], 0
        total = epochs * STEPS_PER_EPOCH
        while True:
            for epoch in range(epochs):
                for _ in range(STEPS_PER_EPOCH):
                    time.sleep(self.step_seconds)
                    step += 1
                    progress(
                        {
                            "steps_completed": step,
                            "total_steps": total,
                            "steps_per_epoch": STEPS_PER_EPOCH,
                            "train_loss": 0.7 / step,
                            "train_accuracy": 0.5 + 0.05 * step,
                        }
                    )
                progress(
                    {
                        "epochs_completed": epoch + 1,
                        "val_loss": 0.8 / (epoch + 1),
                        "val_accuracy": 0.6,
                    }
                )
            if not self.forever:
                break
        (output_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def _dpojax_server(start_server, model_dir, train_fn):
    backend = DpojaxBackend({"tiny": model_dir}, train_fn=train_fn)
    return start_server(backend), backend


def test_dpojax_backend_runs_train_fn_and_reports_progress(start_server, model_dir, tmp_path):
    train = FakeTrain()
    server, backend = _dpojax_server(start_server, model_dir, train)
    settings = settings_for(server, customization_config="tiny@v1", hyperparameters={"epochs": 2})
    result = submit(make_pairs(6), settings, workdir=tmp_path / "run", environ={})
    assert result.status.status == "completed" and result.status.epochs_completed == 2

    (call,) = train.calls
    assert call["model_dir"] == model_dir and (call["train"], call["val"]) == (4, 2)
    assert call["hp"]["epochs"] == 2 and call["hp"]["dpo"]["ref_policy_kl_penalty"] == 0.1
    assert call["train_path"].is_relative_to(server.store.root)  # the uploaded file itself

    progress = [h.progress for h in result.history if h.progress is not None]
    assert progress == sorted(progress) and progress[-1] == 100.0
    assert any(0 < p < 100 for p in progress)
    assert result.status.train_loss == pytest.approx(0.7 / 4)
    assert result.status.val_loss == pytest.approx(0.4)

    job = server.store.jobs[result.job_id]
    body = httpx.get(f"{server.url}/v1/customization/jobs/{job.id}/status").json()
    assert set(body["metrics"]["keys"]) == {
        "train_loss",
        "val_loss",
        "train_accuracy",
        "val_accuracy",
    }
    assert len(body["metrics"]["metrics"]["train_loss"]) == 4 and body["steps_completed"] == 4
    assert "model written to" in body["status_logs"][-1]["message"]
    out = server.store.snapshot()["jobs"][job.id]["output_dir"]
    assert out == str(call["output_dir"]) and (Path(out) / "config.json").is_file()


def test_dpojax_backend_failure_reaches_the_client(start_server, model_dir, tmp_path):
    server, _ = _dpojax_server(start_server, model_dir, FakeTrain(fail="loss became NaN at step 3"))
    settings = settings_for(server, customization_config="tiny")
    with pytest.raises(JobFailedError) as info:  # 12 pairs: enough records for batch_size 8
        submit(make_pairs(12), settings, workdir=tmp_path, environ={})
    assert "loss became NaN at step 3" in info.value.message


def test_dpojax_backend_cancel_stops_training(start_server, model_dir, tmp_path):
    train = FakeTrain(step_seconds=0.01, forever=True)
    server, backend = _dpojax_server(start_server, model_dir, train)
    polls = []

    def sleep(seconds):
        polls.append(seconds)
        time.sleep(seconds)
        if len(polls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(SubmitInterrupted):
        submit(
            make_pairs(12),
            settings_for(server, customization_config="tiny"),
            workdir=tmp_path,
            environ={},
            sleep=sleep,
            confirm_cancel=lambda job_id: True,
        )
    backend.join(timeout=5)
    (job,) = server.store.jobs.values()
    assert job.status == "cancelled"


def test_dpojax_backend_rejects_unknown_config(start_server, model_dir, tmp_path):
    server, _ = _dpojax_server(start_server, model_dir, FakeTrain())
    with pytest.raises(RequestRejectedError) as info:
        submit(
            make_pairs(3),
            settings_for(server, customization_config="nope@v1"),
            workdir=tmp_path,
            environ={},
        )
    assert "unknown customization config 'nope@v1'" in info.value.message


@pytest.mark.slow
def test_command_line_server_serves_a_submission(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = tmp_path / "root"
    faults = tmp_path / "faults.json"  # the first status poll fails; the client retries
    faults.write_text(json.dumps({"rules": [{"path": "/status$", "status": 503, "times": 1}]}))
    cmd = [
        sys.executable,
        "-m",
        "dpojax.customizer_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend",
        "simulate",
        "--root",
        str(root),
        "--seconds-per-epoch",
        "0.05",
        "--log-level",
        "warning",
        "--faults",
        str(faults),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        assert httpx.get(f"{url}/_admin/state").status_code == 404  # admin is opt-in
        settings = {
            "entity_host": url,
            "datastore_host": url,
            "namespace": "cli",
            "customization_config": "cfg",
            "poll_interval_seconds": 0.05,
            # 3 pairs make 2 training records: the server refuses a larger batch
            "hyperparameters": {"epochs": 1, "batch_size": 2},
        }
        result = submit(make_pairs(3), settings, workdir=tmp_path / "run", environ={})
        assert result.status.status == "completed"
        stored = root / "datastore/datasets/cli/dpojax-dpo/training/training_file.jsonl"
        assert stored.read_text() == result.training_file.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
