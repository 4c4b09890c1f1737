"""Restarts (issue 50, defect 8): a server started again on the same `--root` answers for the
jobs, datasets and repositories of the one before (which answered 404 for all of them), and a job
that was training when the server stopped is `failed` with the reason."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest

from dpojax.customizer_server.backends import DpojaxBackend
from dpojax.customizer_server.persistence import STATE_FILE, StateError
from tests.helpers.customizer import AUTH, TOKEN

JOB = {
    "config": "tiny@v1",
    "dataset": {"name": "ds", "namespace": "ns"},
    "hyperparameters": {"training_type": "dpo", "finetuning_type": "lora", "epochs": 1},
}


_CLIENT = httpx.Client(headers=AUTH, timeout=10)  # one client: no new TLS context per call


def _post(url: str, path: str, **kwargs) -> httpx.Response:
    return _CLIENT.post(url + path, **kwargs)


def _get(url: str, path: str) -> httpx.Response:
    return _CLIENT.get(url + path)


def _upload(url: str) -> None:
    """Namespace, dataset repository with a training file, and the dataset registration."""
    assert _post(url, "/v1/namespaces", json={"id": "ns"}).status_code == 201
    repo = {"name": "ns/ds", "type": "dataset"}
    assert _post(url, "/v1/hf/api/repos/create", json=repo).status_code == 200
    pair = {"prompt": "p", "chosen_response": "a", "rejected_response": "b"}
    content = base64.b64encode((json.dumps(pair) + "\n").encode()).decode()
    lines = [
        {"key": "header", "value": {"summary": "data"}},
        {"key": "file", "value": {"path": "training/training_file.jsonl", "content": content}},
    ]
    lines[1]["value"]["encoding"] = "base64"
    body = "".join(json.dumps(line) + "\n" for line in lines)
    assert _post(url, "/v1/hf/api/datasets/ns/ds/commit/main", content=body).status_code == 200
    dataset = {"name": "ds", "namespace": "ns", "files_url": "hf://datasets/ns/ds"}
    assert _post(url, "/v1/datasets", json=dataset).status_code == 201


class HeldTrain:
    """A training function that reports one step, then waits until released."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, model_dir, train_path, val_path, output_dir, hp, progress):
        progress({"steps_completed": 1, "total_steps": 4, "train_loss": 0.5})
        self.started.set()
        self.release.wait(10)


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    path.mkdir()
    return path


def _wait(predicate, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_jobs_datasets_and_files_survive_a_restart(start_server, tmp_path, model_dir):
    """Before: after a restart every job and dataset answered 404."""
    root = tmp_path / "root"
    server = start_server(DpojaxBackend({"tiny": model_dir}, train_fn=lambda *a: None), root=root)
    _upload(server.url)
    key = {"Idempotency-Key": "k1"}
    done = _post(server.url, "/v1/customization/jobs", json=JOB, headers=key).json()
    _wait(
        lambda: (
            _get(server.url, f"/v1/customization/jobs/{done['id']}").json()["status"] == "completed"
        )
    )
    before = _get(server.url, f"/v1/customization/jobs/{done['id']}/status").json()
    server.stop()

    again = start_server(DpojaxBackend({"tiny": model_dir}, train_fn=lambda *a: None), root=root)
    url = again.url
    assert _get(url, "/v1/namespaces/ns").status_code == 200
    assert _get(url, "/v1/datasets/ns/ds").json()["files_url"] == "hf://datasets/ns/ds"
    info = _get(url, "/v1/hf/api/datasets/ns/ds").json()
    assert info["siblings"] == [{"rfilename": "training/training_file.jsonl"}]
    assert _get(url, "/v1/hf/datasets/ns/ds/resolve/main/training/training_file.jsonl").text
    after = _get(url, f"/v1/customization/jobs/{done['id']}/status").json()
    assert after["status"] == "completed" and after["status_logs"] == before["status_logs"]
    assert after["metrics"] == before["metrics"]
    listed = _get(url, "/v1/customization/jobs").json()["data"]
    assert [j["id"] for j in listed] == [done["id"]]
    # the same idempotency key still names the same job; a new job trains on the kept dataset
    same = _post(url, "/v1/customization/jobs", json=JOB, headers=key).json()
    assert same["id"] == done["id"]
    assert _post(url, "/v1/customization/jobs", json=JOB).status_code == 200
    # a name taken before the restart is still taken
    dataset = {"name": "ds", "namespace": "ns", "files_url": "hf://datasets/ns/ds"}
    assert _post(url, "/v1/datasets", json=dataset).status_code == 409


def test_a_job_training_when_the_server_stops_is_failed_with_the_reason(
    start_server, tmp_path, model_dir
):
    """Before: the job answered 404 after the restart, its training orphaned."""
    root, train = tmp_path / "root", HeldTrain()
    server = start_server(
        DpojaxBackend({"tiny": model_dir}, train_fn=train), root=root, token=TOKEN
    )
    _upload(server.url)
    job = _post(server.url, "/v1/customization/jobs", json=JOB).json()
    assert train.started.wait(5)
    server.stop()  # the process "dies": nothing more is written under the root

    again = start_server(DpojaxBackend({"tiny": model_dir}, train_fn=train), root=root, token=TOKEN)
    status = _get(again.url, f"/v1/customization/jobs/{job['id']}/status").json()
    assert status["status"] == "failed"
    assert status["status_logs"][-1]["message"] == "server restarted while the job was running"
    assert "submit the job again" in status["status_logs"][-1]["detail"]
    train.release.set()  # the old thread ends; it must not overwrite the restarted state
    time.sleep(0.1)
    saved = json.loads((root / "jobs" / job["id"] / "job.json").read_text())
    assert saved["status"] == "failed"
    cancel = _post(again.url, f"/v1/customization/jobs/{job['id']}/cancel")
    assert cancel.status_code == 200 and cancel.json()["status"] == "failed"


def test_a_damaged_state_file_stops_the_start_naming_it(start_server, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / STATE_FILE).write_text('{"version": 1, "namespaces": [')
    with pytest.raises(StateError, match=f"{root / STATE_FILE}: cannot read"):
        start_server(root=root)
