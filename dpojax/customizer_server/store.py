"""State of the local Customizer server: namespaces, Datastore repos (files on disk), datasets,
jobs, deployment configs and model deployments, plus a request log for tests.

Uploaded files are kept under `<root>/datastore/<type>s/<namespace>/<name>/<path>`; every commit
is recorded (summary, paths, content sha256) so tests can check that nothing was uploaded twice.
Job outputs of the dpojax backend go to `<root>/models/<job id>/`; the copy of the dataset a job
was created with, to `<root>/jobs/<job id>/dataset/`. `persistence` saves the rest of the state
under the root and loads it when the server starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from dpojax.customizer_server.backends import Job, now_iso
from dpojax.customizer_server.models import MAX_PATH, SAFE_PATH_PART
from dpojax.data.pair_files import TRAINING_FILE, VALIDATION_FILE


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of `data` (what the Hub calls a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


MAX_PATH_PARTS = 16


def safe_relpath(path: str) -> PurePosixPath:
    """A repo-relative path: at most MAX_PATH_PARTS parts, each in the safe alphabet
    (`models.SAFE_PATH_PART`), none `.` or `..`, no absolute root, no empty parts."""
    parts = path.split("/") if isinstance(path, str) else []
    ok = (
        0 < len(path or "") <= MAX_PATH
        and len(parts) <= MAX_PATH_PARTS
        and all(re.fullmatch(SAFE_PATH_PART, part) and part not in (".", "..") for part in parts)
    )
    if not ok:
        raise ValueError(
            f"invalid path in repo: {str(path)[:200]!r} (parts of letters, digits and ._@+=-, "
            "no '.' or '..')"
        )
    return PurePosixPath(path)


class CommitConflict(ValueError):
    """A commit that would put a file where a folder is, or the reverse."""


def _conflicts(existing: set[str], new: list[str]) -> list[str]:
    """Paths of `new` that are a folder of another file, or under another file."""
    every = existing | set(new)
    folders = {
        str(parent) for p in every for parent in PurePosixPath(p).parents if str(parent) != "."
    }
    return [
        p for p in new if p in folders or any(str(q) in every for q in PurePosixPath(p).parents)
    ]


def _remove_empty_tree(directory: Path) -> None:
    """Deletes `directory` when it holds only (empty) folders; an OSError otherwise."""
    for sub in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        sub.rmdir()
    directory.rmdir()


@dataclass
class Repo:
    """One Datastore (HF-style) repository."""

    repo_type: str
    namespace: str
    name: str
    directory: Path
    files: dict[str, str] = field(default_factory=dict)  # path -> git blob oid
    commits: list[dict[str, Any]] = field(default_factory=list)

    def _remove(self, file: Path) -> None:
        """Deletes `file` and the folders it leaves empty, up to the repo's own."""
        file.unlink(missing_ok=True)
        parent = file.parent
        while parent != self.directory and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    @property
    def repo_id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def head(self) -> str:
        return self.commits[-1]["oid"] if self.commits else "0" * 40

    def commit(
        self,
        summary: str,
        files: dict[str, bytes],
        deleted: list[str],
        folders: list[str] = (),
    ) -> str:
        """Write `files`, delete `deleted` and every file under `folders`, record the commit and
        return its oid; all of it or nothing (new contents are staged next to their targets and
        moved into place only once every one is written)."""
        # Only recorded files are deleted (a deleted path that names a folder, or nothing, is
        # ignored, as the Hub does).
        gone = {
            p for p in self.files if p in deleted or any(p.startswith(f + "/") for f in folders)
        }
        remaining = set(self.files) - gone - set(files)
        clash = _conflicts(remaining, sorted(files))
        if clash:
            raise CommitConflict(f"{clash[0]}: a file and a folder of the same name in the repo")
        # New contents are staged in a folder of their own first, so that neither a file that
        # this commit deletes nor a folder left empty by earlier deletions is in their way.
        stage = self.directory / f".commit-{uuid.uuid4().hex[:12]}"
        try:
            staged = []
            for n, (path, data) in enumerate(files.items()):
                target = self.directory / safe_relpath(path)
                stage.mkdir(parents=True, exist_ok=True)
                (stage / str(n)).write_bytes(data)
                staged.append((stage / str(n), target, path, data))
            for path in gone:
                self._remove(self.directory / safe_relpath(path))
                self.files.pop(path, None)
            for tmp, target, path, data in staged:
                if target.is_dir():  # holds no recorded file (checked above): a leftover
                    _remove_empty_tree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, target)
                self.files[path] = git_blob_oid(data)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        oid = hashlib.sha1(
            f"{self.head}{summary}{sorted(self.files.items())}{uuid.uuid4()}".encode()
        )
        record = {
            "oid": oid.hexdigest(),
            "summary": summary,
            "paths": sorted(files),
            "deleted": sorted(gone),
            "sha256": {p: hashlib.sha256(d).hexdigest() for p, d in files.items()},
            "created_at": now_iso(),
        }
        self.commits.append(record)
        return record["oid"]


class Store:
    """Everything the server remembers; one lock guards the collections."""

    def __init__(self, root: Path, deployment_ready_seconds: float = 0.5) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.deployment_ready_seconds = deployment_ready_seconds
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.datastore_namespaces: set[str] = set()
        self.repos: dict[tuple[str, str, str], Repo] = {}
        self.datasets: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobs: dict[str, Job] = {}
        self.job_payloads: dict[str, dict[str, Any]] = {}
        self.idempotency: dict[str, str] = {}
        self.deployment_configs: dict[tuple[str, str], dict[str, Any]] = {}
        self.deployments: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.closed = False  # set when the server stops: nothing more is written to state files

    # ------------------------------------------------------------------ repos

    def repo(self, repo_type: str, namespace: str, name: str) -> Repo | None:
        return self.repos.get((repo_type, namespace, name))

    def create_repo(self, repo_type: str, namespace: str, name: str) -> tuple[Repo, bool]:
        """`(repo, created)`; existing repos are returned unchanged. The repo's directory is
        always inside the root (ValueError otherwise)."""
        safe_relpath(f"{repo_type}s/{namespace}/{name}")
        with self.lock:
            key = (repo_type, namespace, name)
            if key in self.repos:
                return self.repos[key], False
            directory = self.root / "datastore" / f"{repo_type}s" / namespace / name
            if not directory.resolve().is_relative_to(self.root.resolve()):
                raise ValueError(f"repository {namespace}/{name} would be outside the root")
            directory.mkdir(parents=True, exist_ok=True)
            repo = Repo(repo_type, namespace, name, directory)
            self.repos[key] = repo
            return repo, True

    def snapshot_dataset(
        self, dataset: dict[str, Any], job_id: str
    ) -> tuple[Path | None, Path | None]:
        """Copies of the training and validation files of a job's dataset, taken now, in
        `<root>/jobs/<job id>/dataset/` (the job trains on these: a file uploaded later under the
        same dataset name, as NeMo Agent Toolkit does run after run, is not the job's data);
        None for a file not uploaded."""
        found = self.dataset_files(dataset)
        folder = self.root / "jobs" / job_id / "dataset"
        copies: list[Path | None] = []
        for path in found:
            if path is None:
                copies.append(None)
                continue
            target = folder / path.relative_to(path.parent.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)  # a commit replaces files by rename: one version
            copies.append(target)
        return copies[0], copies[1]

    def drop_snapshot(self, job_id: str) -> None:
        """Deletes the dataset copies of a job that was not created."""
        shutil.rmtree(self.root / "jobs" / job_id, ignore_errors=True)

    def dataset_files(self, dataset: dict[str, Any]) -> tuple[Path | None, Path | None]:
        """Training and validation files of a job's dataset (`{name, namespace}`), if uploaded
        (the live files of the Datastore; a job takes `snapshot_dataset`)."""
        namespace, name = dataset.get("namespace") or "default", dataset.get("name") or ""
        with self.lock:
            entry = self.datasets.get((namespace, name))
            files_url = (entry or {}).get("files_url") or f"hf://datasets/{namespace}/{name}"
            repo_id = files_url.split("hf://datasets/", 1)[-1].strip("/")
            ns, _, repo_name = repo_id.partition("/")
            repo = self.repo("dataset", ns, repo_name)
        if repo is None:
            return None, None
        paths = []
        for rel in (TRAINING_FILE, VALIDATION_FILE):
            path = repo.directory / rel
            paths.append(path if path.is_file() else None)
        return paths[0], paths[1]

    # ------------------------------------------------------------------ deployments

    def deployment_view(self, record: dict[str, Any]) -> dict[str, Any]:
        """A deployment as listed, with readiness derived from its age."""
        out = {k: v for k, v in record.items() if not k.startswith("_")}
        ready = time.monotonic() - record["_created"] >= self.deployment_ready_seconds
        status = record.get("_forced_status") or ("ready" if ready else "pending")
        out["status_details"] = {"status": status, "description": f"deployment is {status}"}
        out["deployed"] = status == "ready"
        return out

    def add_deployment(self, body: dict[str, Any], *, forced_status: str | None = None) -> dict:
        namespace = body.get("namespace") or "default"
        name = body["name"]
        record = {
            "name": name,
            "namespace": namespace,
            "config": body.get("config"),
            "description": body.get("description"),
            "url": f"http://nim.local/{namespace}/{name}",
            "models": body.get("models") or [],
            "created_at": now_iso(),
            "_created": time.monotonic(),
            "_forced_status": forced_status,
        }
        with self.lock:
            self.deployments[(namespace, name)] = record
        return self.deployment_view(record)

    # ------------------------------------------------------------------ state dump (admin)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "namespaces": sorted(self.namespaces),
                "datastore_namespaces": sorted(self.datastore_namespaces),
                "repos": {
                    f"{r.repo_type}:{r.repo_id}": {
                        "files": dict(r.files),
                        "commits": list(r.commits),
                        "directory": str(r.directory),
                    }
                    for r in self.repos.values()
                },
                "datasets": {f"{ns}/{n}": dict(d) for (ns, n), d in self.datasets.items()},
                "jobs": {
                    jid: {
                        "payload": self.job_payloads.get(jid),
                        "status": job.status,
                        "output_model": job.output_model,
                        "output_dir": str(job.output_dir) if job.output_dir else None,
                    }
                    for jid, job in self.jobs.items()
                },
                "deployment_configs": {
                    f"{ns}/{n}": dict(c) for (ns, n), c in self.deployment_configs.items()
                },
                "deployments": {
                    f"{ns}/{n}": self.deployment_view(d) for (ns, n), d in self.deployments.items()
                },
            }
