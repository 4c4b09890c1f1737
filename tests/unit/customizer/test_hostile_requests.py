"""The local server refuses hostile requests with a 4xx and stays healthy: no path outside
`--root`, no non-finite number stored, typed fields, bounded bodies, commits whole or not at all,
invalid base64 refused; and the dpojax backend's queue is bounded and never strands a job."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from dpojax.customizer_server.backends import DpojaxBackend, SimulateBackend
from dpojax.customizer_server.store import Repo

HF = "/v1/hf"


def _files_outside(base: Path, root: Path) -> list[str]:
    """Everything under `base` that is neither `root`, inside it, nor one of its parents."""
    parents = set(root.parents)
    return [
        str(p) for p in base.rglob("*") if p != root and p not in parents and root not in p.parents
    ]


def _healthy(url: str) -> None:
    for path in ("/v1/customization/jobs", "/v1/deployment/model-deployments", "/health"):
        response = httpx.get(url + path)
        assert response.status_code == 200, (path, response.text)


@pytest.fixture
def deep_server(tmp_path):
    """A server whose root is a few levels down, so `..` escapes would land inside tmp_path."""
    from dpojax.customizer_server import serve_in_thread

    root = tmp_path / "a" / "b" / "c" / "root"
    handle = serve_in_thread(root, SimulateBackend(seconds_per_epoch=0.05), max_body_bytes=1 << 20)
    yield handle, root
    handle.stop()


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "type": "../../x"},
        {"name": "x", "type": "/tmp/absolute"},
        {"name": "x", "type": "dataset", "organization": "../../escape"},
        {"name": "x", "organization": "/tmp/absolute"},
        {"name": "../../x", "type": "dataset"},
        {"name": "ns/../../x", "type": "dataset"},
        {"name": "..", "organization": "ns"},
        {"name": "x\x00y"},
        {"name": "a/b/c"},
    ],
)
def test_repo_create_refuses_paths_outside_the_root(deep_server, tmp_path, body):
    server, root = deep_server
    response = httpx.post(f"{server.url}{HF}/api/repos/create", json=body)
    assert response.status_code == 422, response.text
    assert not _files_outside(tmp_path, root)
    assert not list((root / "datastore").rglob("*")) if (root / "datastore").exists() else True


def test_commit_paths_cannot_escape_the_repo(deep_server, tmp_path):
    server, root = deep_server
    httpx.post(f"{server.url}{HF}/api/repos/create", json={"name": "ns/ds", "type": "dataset"})
    url = f"{server.url}{HF}/api/datasets/ns/ds/commit/main"
    for path in ("../../../../x", "/etc/x", "a/../../x", "a//b", ".", "a\\..\\x", "a\x00b"):
        line = {"key": "file", "value": {"path": path, "content": "x"}}
        response = httpx.post(url, content=json.dumps(line) + "\n")
        assert response.status_code == 422, (path, response.text)
    assert not _files_outside(tmp_path, root)
    assert server.store.repo("dataset", "ns", "ds").files == {}


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_and_lists_stay_healthy(server, token):
    bodies = {
        "/v1/namespaces": '{"id": "ns1", "description": %s}',
        "/v1/deployment/model-deployments": '{"name": "d1", "gpu": %s}',
        "/v1/deployment/configs": '{"name": "c1", "nim_deployment": {"gpu": %s}}',
        "/v1/customization/jobs": (
            '{"config": "c", "dataset": "ns/ds", "hyperparameters": '
            '{"finetuning_type": "lora", "learning_rate": %s}}'
        ),
    }
    for path, text in bodies.items():
        response = httpx.post(
            server.url + path,
            content=text % token,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 422, (path, response.text)
        assert "finite" in response.json()["detail"]
    _healthy(server.url)
    assert not server.store.deployments and not server.store.namespaces


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "[1e999]"])
def test_numbers_that_overflow_are_refused_in_extra_fields(dataset_server, literal):
    """Before: `1e400` (read as infinity by Python's parser, past the NaN/Infinity check) in an
    extra field was stored, and every later GET of it, and the job list, answered 500."""
    server = dataset_server
    job = '{"config": "c", "dataset": "ns/ds", "hyperparameters": {"finetuning_type": "lora"}'
    bodies = {
        "/v1/namespaces": '{"id": "ns1", "extra": %s}',
        "/v1/datasets": '{"name": "d1", "files_url": "hf://datasets/ns/ds", "extra": %s}',
        "/v1/deployment/model-deployments": '{"name": "d1", "extra": %s}',
        "/v1/deployment/configs": '{"name": "c1", "extra": {"deep": %s}}',
        "/v1/customization/jobs": job + ', "extra": %s}',
    }
    for path, text in bodies.items():
        response = httpx.post(
            server.url + path, content=text % literal, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, (path, response.text)
        assert "finite" in response.json()["detail"]
    _healthy(server.url)
    assert not server.store.namespaces and not server.store.datasets and not server.store.jobs
    json.dumps(server.store.snapshot(), allow_nan=False)


def test_a_body_model_never_keeps_what_json_cannot_serve():
    """Past the guard (a body parsed some other way), the request models refuse unknown fields
    that do not serialise as strict JSON, so the store cannot hold them."""
    from pydantic import ValidationError

    from dpojax.customizer_server.models import DatasetIn, NamespaceIn

    for bad in (float("inf"), float("nan"), {"x": [float("-inf")]}):
        with pytest.raises(ValidationError, match="finite JSON"):
            NamespaceIn.model_validate({"id": "ns", "extra": bad})
    ok = {"name": "d", "files_url": "u", "zero": -0.0, "huge": 10**400}
    assert DatasetIn.model_validate(ok).model_extra == {"zero": -0.0, "huge": 10**400}


# Shapes that answered 500 before typed validation (the first 12), or were accepted and stored
# (the rest; `"epochs": "abc"` then made its job's status answer 500 forever).
WRONG_TYPES = [
    ("/v1/datasets", {"name": "z", "namespace": ["a"], "files_url": "u"}),
    ("/v1/deployment/configs", {"name": "c2", "namespace": ["x"]}),
    ("/v1/deployment/model-deployments", {"name": "d3", "namespace": {"a": 1}}),
    (
        "/v1/customization/jobs",
        {"config": "c", "dataset": {"name": ["b"]}, "hyperparameters": {"finetuning_type": "lora"}},
    ),
    (f"{HF}/api/repos/create", {"name": 5}),
    (f"{HF}/api/repos/create", {"name": ["x"]}),
    (f"{HF}/api/repos/create", {"name": "x", "organization": 5}),
    (f"{HF}/api/repos/create", {"name": "x", "type": ["dataset"]}),
    (f"{HF}/api/datasets/ns/ds/preupload/main", {"files": "x"}),
    (f"{HF}/api/datasets/ns/ds/preupload/main", {"files": [5]}),
    (f"{HF}/api/datasets/ns/ds/preupload/main", {"files": [{"path": 5}]}),
    (f"{HF}/api/datasets/ns/ds/preupload/main", {"files": [{"path": "../x"}]}),
    (f"{HF}/api/repos/create", {"name": "x", "type": 5}),
    ("/v1/namespaces", {"id": "ok", "description": {"x": 1}}),
    ("/v1/datasets", {"name": "x", "files_url": ["hf://"]}),
    ("/v1/datasets", {"name": "y", "namespace": 5, "files_url": "u"}),
    ("/v1/deployment/model-deployments", {"name": "d", "models": "abc"}),
    (
        "/v1/customization/jobs",
        {
            "config": "c",
            "dataset": "ns/ds",
            "hyperparameters": {"finetuning_type": "lora", "epochs": "abc"},
        },
    ),
    (
        "/v1/customization/jobs",
        {
            "config": "c",
            "dataset": "ns/ds",
            "hyperparameters": {"finetuning_type": "lora", "batch_size": True},
        },
    ),
]
# Commit lines that answered 500.
BAD_COMMIT_LINES = [
    '{"key": "file", "value": "str"}',
    '{"key": "file", "value": {"path": 5, "content": "x"}}',
    '{"key": "file", "value": {"path": "a", "content": 5}}',
    '{"key": "header", "value": "s"}',
    '["x"]',
    "5",
    '{"key": "deletedFile", "value": {"path": ["a"]}}',
    '{"key": "file", "value": {"path": "a", "content": "x", "encoding": "gzip"}}',
]


@pytest.fixture
def dataset_server(server):
    _upload_dataset(server.url, "ns", "ds")
    return server


@pytest.mark.parametrize("path, body", WRONG_TYPES)
def test_wrong_types_are_refused_with_422(dataset_server, path, body):
    server = dataset_server
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    _healthy(server.url)
    assert not server.store.jobs and not server.store.deployments and not server.store.namespaces
    assert list(server.store.repos) == [("dataset", "ns", "ds")]


@pytest.mark.parametrize("line", BAD_COMMIT_LINES)
def test_malformed_commit_lines_are_refused_with_422(dataset_server, line):
    server = dataset_server
    response = httpx.post(f"{server.url}{HF}/api/datasets/ns/ds/commit/main", content=line + "\n")
    assert response.status_code == 422, response.text
    assert len(server.store.repo("dataset", "ns", "ds").commits) == 1  # the dataset's upload


def test_a_string_epochs_job_cannot_break_its_status(start_server, tmp_path):
    """Before: `"epochs": "abc"` was accepted and its status answered 500 forever."""
    server = start_server()
    _upload_dataset(server.url, "ns", "ds")
    body = {
        "config": "c",
        "dataset": "ns/ds",
        "hyperparameters": {"finetuning_type": "lora", "epochs": "abc"},
    }
    assert httpx.post(server.url + "/v1/customization/jobs", json=body).status_code == 422
    body["hyperparameters"]["epochs"] = 1
    job = httpx.post(server.url + "/v1/customization/jobs", json=body).json()
    status = httpx.get(f"{server.url}/v1/customization/jobs/{job['id']}/status")
    assert status.status_code == 200


def _commit(url: str, ns: str, name: str, lines: list[dict]) -> httpx.Response:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    return httpx.post(f"{url}{HF}/api/datasets/{ns}/{name}/commit/main", content=text)


def _upload_dataset(url: str, ns: str, name: str, chosen: str = "a") -> None:
    httpx.post(f"{url}{HF}/api/repos/create", json={"name": f"{ns}/{name}", "type": "dataset"})
    pair = {"prompt": "p", "chosen_response": chosen, "rejected_response": "b"}
    content = base64.b64encode((json.dumps(pair) + "\n").encode()).decode()
    lines = [
        {"key": "header", "value": {"summary": "data"}},
        {
            "key": "file",
            "value": {
                "path": "training/training_file.jsonl",
                "content": content,
                "encoding": "base64",
            },
        },
    ]
    assert _commit(url, ns, name, lines).status_code == 200


def test_invalid_base64_is_refused_not_saved_empty(server):
    httpx.post(f"{server.url}{HF}/api/repos/create", json={"name": "ns/ds", "type": "dataset"})
    good = base64.b64encode(b"hello").decode()
    lines = [
        {"key": "file", "value": {"path": "a.txt", "content": good, "encoding": "base64"}},
        {
            "key": "file",
            "value": {"path": "b.txt", "content": "!!!!", "encoding": "base64"},
        },
    ]
    response = _commit(server.url, "ns", "ds", lines)
    assert response.status_code == 422 and "base64" in response.json()["detail"]
    repo = server.store.repo("dataset", "ns", "ds")
    assert repo.files == {} and repo.commits == []  # not even the good file
    assert not [p for p in repo.directory.rglob("*") if p.is_file()]


def test_a_commit_failing_halfway_leaves_nothing(server, monkeypatch):
    httpx.post(f"{server.url}{HF}/api/repos/create", json={"name": "ns/ds", "type": "dataset"})
    repo: Repo = server.store.repo("dataset", "ns", "ds")
    assert _commit(server.url, "ns", "ds", [_file("keep.txt", "v1")]).status_code == 200
    real_write = Path.write_bytes
    writes = []

    def failing_write(self, data):
        writes.append(self.name)
        if len(writes) == 2:
            raise OSError(28, "No space left on device", str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", failing_write)
    with pytest.raises(OSError):  # the in-process store call: the disk error surfaces
        repo.commit("two files", {"keep.txt": b"v2", "new.txt": b"new"}, [])
    monkeypatch.undo()
    assert len(repo.commits) == 1 and set(repo.files) == {"keep.txt"}
    assert (repo.directory / "keep.txt").read_bytes() == b"v1"
    assert sorted(p.name for p in repo.directory.iterdir()) == ["keep.txt"]  # no staged leftovers


def _file(path: str, text: str) -> dict:
    return {"key": "file", "value": {"path": path, "content": text}}


def test_file_and_folder_of_one_name_is_refused(server):
    httpx.post(f"{server.url}{HF}/api/repos/create", json={"name": "ns/ds", "type": "dataset"})
    assert _commit(server.url, "ns", "ds", [_file("a", "x")]).status_code == 200
    assert _commit(server.url, "ns", "ds", [_file("a/b", "x")]).status_code == 422
    assert _commit(server.url, "ns", "ds", [_file("c/d", "x"), _file("c", "y")]).status_code == 422
    folder = {"key": "deletedFolder", "value": {"path": "a"}}
    assert _commit(server.url, "ns", "ds", [folder]).status_code == 200
    _healthy(server.url)


def test_a_file_may_take_the_place_of_a_deleted_folder_and_back(server):
    """Found by the fuzz test: a folder emptied by deletions, or a file deleted in the same
    commit, must not stand in the way of a new file of that name (was a 500)."""
    httpx.post(f"{server.url}{HF}/api/repos/create", json={"name": "ns/ds", "type": "dataset"})
    repo: Repo = server.store.repo("dataset", "ns", "ds")
    gone = {"key": "deletedFile", "value": {"path": "a/b/c"}}
    assert _commit(server.url, "ns", "ds", [_file("a/b/c", "x")]).status_code == 200
    assert _commit(server.url, "ns", "ds", [gone]).status_code == 200
    assert not (repo.directory / "a").exists()  # emptied folders go with their last file
    (repo.directory / "a" / "b").mkdir(parents=True)  # a leftover from an older server
    assert _commit(server.url, "ns", "ds", [_file("a", "file")]).status_code == 200
    assert (repo.directory / "a").read_text() == "file" and set(repo.files) == {"a"}
    swap = [{"key": "deletedFile", "value": {"path": "a"}}, _file("a/d", "inside")]
    assert _commit(server.url, "ns", "ds", swap).status_code == 200
    assert (repo.directory / "a" / "d").read_text() == "inside" and set(repo.files) == {"a/d"}
    assert not [p for p in repo.directory.iterdir() if p.name.startswith(".")]  # no staging
    _healthy(server.url)


def test_oversized_bodies_are_refused_without_being_kept(deep_server):
    server, _ = deep_server  # max_body_bytes = 1 MiB
    big = b'{"id": "' + b"x" * (2 << 20) + b'"}'
    response = httpx.post(
        server.url + "/v1/namespaces", content=big, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413

    def chunks():  # no Content-Length: counted while reading
        for _ in range(3):
            yield b"x" * (512 << 10)

    response = httpx.post(f"{server.url}{HF}/api/datasets/a/b/commit/main", content=chunks())
    assert response.status_code == 413
    deep = "[" * 200 + "]" * 200
    response = httpx.post(
        server.url + "/v1/deployment/configs",
        content='{"name": "x", "extra": ' + deep + "}",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 422
    _healthy(server.url)


def test_the_default_body_limit_is_bounded():
    from dpojax.customizer_server.guard import DEFAULT_MAX_BODY_BYTES

    assert DEFAULT_MAX_BODY_BYTES <= 64 << 20


# ----------------------------------------------------------------- the dpojax backend's queue


class BlockingTrain:
    """A train function that reports one step and waits until released (or cancelled)."""

    def __init__(self):
        self.release = threading.Event()
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()
        self.val_paths = []

    def __call__(self, model_dir, train_path, val_path, output_dir, hp, progress):
        self.val_paths.append(val_path)
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            while not self.release.wait(0.01):
                progress({"steps_completed": 1, "total_steps": 2, "train_loss": 0.5})
            (Path(output_dir) / "config.json").write_text("{}")
        finally:
            with self.lock:
                self.running -= 1


def _job_body(dataset: str = "ns/ds") -> dict:
    return {
        "config": "tiny",
        "dataset": dataset,
        "hyperparameters": {"finetuning_type": "all_weights", "training_type": "dpo", "epochs": 1},
    }


def test_a_batch_larger_than_the_dataset_is_refused(start_server, tmp_path):
    """Before: batch_size=65536 for a dataset of 24 pairs was accepted (and allocated a batch
    of 65536 pairs: 94.7 GB)."""
    model = tmp_path / "model"
    model.mkdir()
    server = start_server(DpojaxBackend({"tiny": model}, train_fn=BlockingTrain()))
    _upload_dataset(server.url, "ns", "ds")  # one record
    body = _job_body()
    body["hyperparameters"]["batch_size"] = 2
    response = httpx.post(server.url + "/v1/customization/jobs", json=body)
    assert response.status_code == 422, response.text
    assert "batch_size 2" in response.json()["detail"] and "at most 1" in response.json()["detail"]
    assert not server.store.jobs and not list((server.store.root / "jobs").glob("*"))


def test_the_simulate_backend_refuses_a_batch_larger_than_the_dataset(start_server, tmp_path):
    """Before: the simulate backend accepted batch_size 65536 for a dataset of one record."""
    server = start_server(SimulateBackend(seconds_per_epoch=0.05))
    _upload_dataset(server.url, "ns", "ds")  # one record
    body = _job_body()
    body["hyperparameters"]["batch_size"] = 65536
    response = httpx.post(server.url + "/v1/customization/jobs", json=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "hyperparameters.batch_size 65536" in detail and "at most 1" in detail
    body["hyperparameters"]["batch_size"] = 1
    assert httpx.post(server.url + "/v1/customization/jobs", json=body).status_code == 200


def test_jobs_are_queued_and_bounded(start_server, tmp_path):
    train = BlockingTrain()
    model = tmp_path / "model"
    model.mkdir()
    backend = DpojaxBackend({"tiny": model}, train_fn=train, max_running=1, max_queued=2)
    server = start_server(backend)
    _upload_dataset(server.url, "ns", "ds")
    answers = [
        httpx.post(server.url + "/v1/customization/jobs", json=_job_body()) for _ in range(6)
    ]
    codes = [a.status_code for a in answers]
    assert codes == [200, 200, 200, 429, 429, 429], codes  # 1 running + 2 queued
    assert "queued" in answers[-1].json()["detail"]
    ids = [a.json()["id"] for a in answers[:3]]
    time.sleep(0.2)
    statuses = [server.store.jobs[i].status for i in ids]
    assert statuses == ["running", "pending", "pending"], statuses
    assert httpx.post(f"{server.url}/v1/customization/jobs/{ids[2]}/cancel").status_code == 200
    assert server.store.jobs[ids[2]].status == "cancelled"  # a queued job: at once
    train.release.set()
    backend.join(timeout=10)
    assert [server.store.jobs[i].status for i in ids] == ["completed", "completed", "cancelled"]
    assert train.most_running == 1
    _healthy(server.url)


def test_a_dataset_without_validation_file_does_not_strand_the_job(start_server, tmp_path):
    """Before: an assert in the job thread killed it and the job stayed `running` forever."""
    train = BlockingTrain()
    train.release.set()
    model = tmp_path / "model"
    model.mkdir()
    backend = DpojaxBackend({"tiny": model}, train_fn=train)
    server = start_server(backend)
    _upload_dataset(server.url, "ns", "ds")  # training file only
    job = httpx.post(server.url + "/v1/customization/jobs", json=_job_body()).json()
    backend.join(timeout=10)
    assert server.store.jobs[job["id"]].status == "completed"
    assert train.val_paths == [None]


def test_a_train_function_crash_ends_the_job_failed(start_server, tmp_path):
    def crash(*args):
        raise AssertionError("boom")

    model = tmp_path / "model"
    model.mkdir()
    backend = DpojaxBackend({"tiny": model}, train_fn=crash)
    server = start_server(backend)
    _upload_dataset(server.url, "ns", "ds")
    job = httpx.post(server.url + "/v1/customization/jobs", json=_job_body()).json()
    backend.join(timeout=10)
    assert server.store.jobs[job["id"]].status == "failed"
    second = httpx.post(server.url + "/v1/customization/jobs", json=_job_body()).json()
    backend.join(timeout=10)  # the worker survived the crash and ran the next job
    assert server.store.jobs[second["id"]].status == "failed"


def test_a_pending_job_trains_on_the_data_it_was_created_with(start_server, tmp_path):
    """Before: a job pointed at the live dataset file, so a pending job trained on a file uploaded
    under the same name after it was created (NeMo Agent Toolkit reuses dataset names)."""
    read = []

    class ReadingTrain(BlockingTrain):
        def __call__(self, model_dir, train_path, val_path, output_dir, hp, progress):
            read.append(json.loads(Path(train_path).read_text())["chosen_response"])
            super().__call__(model_dir, train_path, val_path, output_dir, hp, progress)

    train = ReadingTrain()
    model = tmp_path / "model"
    model.mkdir()
    backend = DpojaxBackend({"tiny": model}, train_fn=train, max_running=1)
    server = start_server(backend)
    _upload_dataset(server.url, "ns", "ds", chosen="first")
    ids = [httpx.post(server.url + "/v1/customization/jobs", json=_job_body()).json()["id"]]
    _upload_dataset(server.url, "ns", "ds", chosen="second")
    ids.append(httpx.post(server.url + "/v1/customization/jobs", json=_job_body()).json()["id"])
    time.sleep(0.2)
    assert server.store.jobs[ids[1]].status == "pending"
    _upload_dataset(server.url, "ns", "ds", chosen="third")  # after both were created
    train.release.set()
    backend.join(timeout=10)
    assert read == ["first", "second"]
    assert [server.store.jobs[i].status for i in ids] == ["completed", "completed"]
    refused = httpx.post(server.url + "/v1/customization/jobs", json=_job_body("ns/none"))
    assert refused.status_code == 422
    assert sorted(p.name for p in (server.store.root / "jobs").iterdir()) == sorted(ids)
