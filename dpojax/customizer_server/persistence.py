"""The local server's state on disk, so a restart keeps its jobs and datasets
(docs/customizer.md#restarts).

- `<root>/server_state.json`: namespaces, Datastore namespaces, repositories (their files and
  commits), datasets, deployment configs, model deployments and idempotency keys; rewritten
  (atomically: a temporary file, fsync, rename) after every request that changed something,
  before its answer is sent (`save_entities`, called by the app's middleware).
- `<root>/jobs/<job id>/job.json`: each job, its request body and its status; rewritten at every
  status change (`StoredJob.set_status`), so a finished job keeps its final metrics.

`load_state` reads both when the server starts. A job that was `pending`, `running` or
`cancelling` when the server stopped (its training thread died with the process) is marked
`failed` with the reason `server restarted while the job was <status>`; nothing is resumed.
A repository file missing from disk is dropped from its repository (with a warning). A state file
that cannot be read stops the start with `StateError`, naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpojax.customizer_server.backends import Job
from dpojax.customizer_server.faults import TERMINAL, JobScript
from dpojax.customizer_server.store import Store, safe_relpath

log = logging.getLogger("dpojax.customizer_server")
STATE_FILE = "server_state.json"
JOB_FILE = "job.json"
VERSION = 1
JOB_ID = re.compile(r"cust-[0-9a-f]{22}")
_JOB_FIELDS = (
    "id namespace config dataset hyperparameters output_model status created_at updated_at "
    "percentage_done epochs_completed steps_completed steps_per_epoch train_loss val_loss "
    "status_logs metrics"
).split()
_PATH_FIELDS = ("train_path", "val_path", "output_dir")


class StateError(RuntimeError):
    """A state file the server cannot start from."""


@dataclasses.dataclass
class StoredJob(Job):
    """A job that writes itself to `<root>/jobs/<id>/job.json` at every status change."""

    payload: dict[str, Any] = dataclasses.field(default_factory=dict)
    on_change: Callable[[Job], None] | None = dataclasses.field(default=None, repr=False)

    def set_status(self, status: str, message: str, detail: str | None = None) -> None:
        super().set_status(status, message, detail)
        if self.on_change is not None:
            self.on_change(self)


def write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StateError(
            f"{path}: cannot read the server's saved state ({exc}); move the file aside to start "
            "without what it records"
        ) from None


# ---------------------------------------------------------------------------- entities


def _entities(store: Store) -> dict[str, Any]:
    repos = [
        {"type": r.repo_type, "namespace": r.namespace, "name": r.name}
        | {"files": dict(r.files), "commits": list(r.commits)}
        for r in store.repos.values()
    ]
    deployments = [
        {k: v for k, v in d.items() if k != "_created"} for d in store.deployments.values()
    ]
    return {
        "version": VERSION,
        "namespaces": list(store.namespaces.values()),
        "datastore_namespaces": sorted(store.datastore_namespaces),
        "repos": repos,
        "datasets": list(store.datasets.values()),
        "deployment_configs": list(store.deployment_configs.values()),
        "deployments": deployments,
        "idempotency": dict(store.idempotency),
    }


def save_entities(store: Store) -> None:
    """Writes `<root>/server_state.json` (nothing once the store is closed)."""
    with store.lock:
        if not getattr(store, "closed", False):
            write_json(store.root / STATE_FILE, _entities(store))


def _load_repo(store: Store, raw: dict[str, Any]) -> None:
    repo, _ = store.create_repo(raw["type"], raw["namespace"], raw["name"])
    repo.commits = list(raw.get("commits") or [])
    for path, oid in dict(raw.get("files") or {}).items():
        if (repo.directory / safe_relpath(path)).is_file():
            repo.files[path] = oid
        else:
            log.warning("%s: file %s is gone from disk; dropped from the repository", repo, path)


def _load_entities(store: Store, state: dict[str, Any], where: Path) -> None:
    if state.get("version") != VERSION:
        raise StateError(f"{where}: version {state.get('version')!r}, expected {VERSION}")
    for record in state.get("namespaces") or []:
        store.namespaces[record["id"]] = record
    store.datastore_namespaces.update(state.get("datastore_namespaces") or [])
    for raw in state.get("repos") or []:
        _load_repo(store, raw)
    for record in state.get("datasets") or []:
        store.datasets[(record["namespace"], record["name"])] = record
    for record in state.get("deployment_configs") or []:
        store.deployment_configs[(record["namespace"], record["name"])] = record
    ready_since = time.monotonic() - store.deployment_ready_seconds
    for record in state.get("deployments") or []:
        store.deployments[(record["namespace"], record["name"])] = record | {
            "_created": ready_since
        }
    store.idempotency.update(state.get("idempotency") or {})


# ---------------------------------------------------------------------------- jobs


def _job_record(store: Store, job: StoredJob) -> dict[str, Any]:
    """The job as saved (caller holds `job.lock`); paths inside the root are kept relative."""
    record = {name: getattr(job, name) for name in _JOB_FIELDS}
    for name in _PATH_FIELDS:
        value = getattr(job, name)
        record[name] = str(Path(value).relative_to(store.root)) if value else None
    record["model_dir"] = str(job.model_dir) if job.model_dir else None
    record["script"] = dataclasses.asdict(job.script)
    record["payload"] = job.payload
    return record


def job_saver(store: Store) -> Callable[[Job], None]:
    """`StoredJob.on_change` for jobs of `store` (writes nothing once the store is closed)."""

    def save(job: Job) -> None:
        if not getattr(store, "closed", False) and isinstance(job, StoredJob):
            write_json(store.root / "jobs" / job.id / JOB_FILE, _job_record(store, job))

    return save


def _load_job(store: Store, record: dict[str, Any], where: Path) -> tuple[StoredJob, bool]:
    """The saved job, and whether it was cut short by the restart (now `failed`)."""
    if not JOB_ID.fullmatch(str(record.get("id"))) or record["id"] != where.parent.name:
        raise StateError(f"{where}: job id {record.get('id')!r} does not match its folder")
    values = {name: record[name] for name in _JOB_FIELDS}
    for name in _PATH_FIELDS:
        rel = record.get(name)
        values[name] = store.root / safe_relpath(rel) if rel else None
    model_dir = record.get("model_dir")
    job = StoredJob(
        **values,
        model_dir=Path(model_dir) if model_dir else None,
        script=JobScript.from_dict(record.get("script") or {}),
        payload=dict(record.get("payload") or {}),
    )
    cut_short = job.status not in TERMINAL
    if cut_short:
        job.set_status(
            "failed",
            f"server restarted while the job was {job.status}",
            "the server process stopped before the job ended; submit the job again",
        )
    job.on_change = job_saver(store)
    return job, cut_short


def load_state(store: Store) -> None:
    """Everything a previous server left under `store.root` (see the module docstring)."""
    state_path = store.root / STATE_FILE
    if state_path.is_file():
        try:
            _load_entities(store, _read_json(state_path), state_path)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise StateError(f"{state_path}: malformed server state ({exc!r})") from None
    restarted = []
    for path in sorted((store.root / "jobs").glob(f"*/{JOB_FILE}")):
        try:
            job, cut_short = _load_job(store, _read_json(path), path)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise StateError(f"{path}: malformed job state ({exc!r})") from None
        if cut_short:
            restarted.append(job)
        store.jobs[job.id] = job
        store.job_payloads[job.id] = job.payload
    for job in restarted:  # written once the job's on_change is set
        job_saver(store)(job)
    store.idempotency = {k: v for k, v in store.idempotency.items() if v in store.jobs}
    if store.jobs or store.datasets:
        log.info(
            "restored %d job(s) (%d marked failed: the server restarted while they ran) and %d "
            "dataset(s) from %s",
            len(store.jobs),
            len(restarted),
            len(store.datasets),
            store.root,
        )
