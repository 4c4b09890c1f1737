"""Training backends of the local Customizer server: what runs a customization job.

A backend implements `TrainingBackend`: `validate(job)` (reject a create request with a 422),
`start(job)`, `status(job)` (refresh and return the job's status fields) and `cancel(job)`.

- `SimulateBackend`: no training; progress advances with wall-clock time (`seconds_per_epoch`),
  with synthetic decreasing losses, and the job ends as the server's `JobScript` says (completed
  by default).
- `DpojaxBackend`: runs a `TrainFn` on the uploaded pair files in a bounded pool of worker
  threads with a bounded queue, and reports what it reports through `progress_callback`. By
  default the function is `dpojax.customizer_server.training.train_job`: real DPO training with
  dpojax's loop, which reports after every step.

`TrainFn(model_dir, train_pairs_path, val_pairs_path, output_dir, hyperparameters,
progress_callback) -> None` writes an HF model directory into `output_dir` (`val_pairs_path` is
None when the dataset has no validation file). It calls
`progress_callback(update)` with any of `epochs_completed`, `steps_completed`, `total_steps`,
`steps_per_epoch`, `train_loss`, `val_loss`, `train_accuracy`, `val_accuracy`; when the job is
cancelled, the callback raises `JobCancelled`, which the function should let propagate.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from dpojax.customizer.client.settings import Hyperparameters
from dpojax.customizer_server.faults import TERMINAL, JobScript

ProgressCallback = Callable[[Mapping[str, Any]], None]
METRIC_KEYS = ("train_loss", "val_loss", "train_accuracy", "val_accuracy")


class TrainFn(Protocol):
    """The training entry point the dpojax backend calls (see the module docstring)."""

    def __call__(
        self,
        model_dir: Path,
        train_pairs_path: Path,
        val_pairs_path: Path,
        output_dir: Path,
        hyperparameters: Mapping[str, Any],
        progress_callback: ProgressCallback,
    ) -> None: ...


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here."""


class JobCancelled(Exception):
    """Raised by `progress_callback` once the job has been cancelled."""


class BackendBusy(RuntimeError):
    """The backend's queue is full (the server answers 429)."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class Job:
    """Server-side state of one customization job (guarded by `lock`)."""

    id: str
    namespace: str
    config: str
    dataset: dict[str, Any]
    hyperparameters: dict[str, Any]
    output_model: str
    script: JobScript = field(default_factory=JobScript)
    train_path: Path | None = None
    val_path: Path | None = None
    output_dir: Path | None = None
    model_dir: Path | None = None
    status: str = "created"
    created_at: str = field(default_factory=now_iso)
    updated_at: str = field(default_factory=now_iso)
    percentage_done: float = 0.0
    epochs_completed: int = 0
    steps_completed: int = 0
    steps_per_epoch: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    status_logs: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    started_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def epochs(self) -> int:
        return max(1, int(self.hyperparameters.get("epochs") or Hyperparameters().epochs))

    def set_status(self, status: str, message: str, detail: str | None = None) -> None:
        """Change status and append a status log entry (call with `lock` held)."""
        self.status = status
        self.updated_at = now_iso()
        entry: dict[str, Any] = {"updated_at": self.updated_at, "message": message}
        if detail:
            entry["detail"] = detail
        self.status_logs.append(entry)

    def add_metric(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append(
            {"step": self.steps_completed, "timestamp": now_iso(), "value": value}
        )

    def status_body(self) -> dict[str, Any]:
        """The `GET .../status` body (call with `lock` held)."""
        keys = [k for k in METRIC_KEYS if self.metrics.get(k)]
        return {
            "id": self.id,
            "status": self.status,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "percentage_done": round(self.percentage_done, 4),
            "epochs_completed": self.epochs_completed,
            "steps_completed": self.steps_completed,
            "steps_per_epoch": self.steps_per_epoch,
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "elapsed_time": round(time.monotonic() - self.started_at, 3) if self.started_at else 0,
            "status_logs": list(self.status_logs),
            "metrics": {"keys": keys, "metrics": {k: list(self.metrics[k]) for k in keys}},
        }


def check_batch_size(job: Job) -> None:
    """`ValueError` naming hyperparameters.batch_size when it is larger than the records of the
    job's training file (where it has one)."""
    batch = job.hyperparameters.get("batch_size")
    if batch is None or job.train_path is None or not job.train_path.is_file():
        return
    with open(job.train_path, "rb") as f:
        records = sum(1 for line in f if line.strip())
    if batch > records:
        raise ValueError(
            f"hyperparameters.batch_size {batch} is larger than the {records} records of "
            f"dataset {job.dataset['namespace']}/{job.dataset['name']}; use at most {records}"
        )


class TrainingBackend(ABC):
    """What runs jobs for the server."""

    name: str = "backend"

    def validate(self, job: Job) -> None:
        """Raise `ValueError` (the server answers 422 with its message) to refuse a job: by
        default, a batch larger than the dataset's training records (every backend)."""
        check_batch_size(job)

    @abstractmethod
    def start(self, job: Job) -> None:
        """Begin running `job` (must return quickly)."""

    @abstractmethod
    def status(self, job: Job) -> dict[str, Any]:
        """Refresh `job` and return its status body."""

    @abstractmethod
    def cancel(self, job: Job) -> None:
        """Ask the job to stop; it ends in `cancelled`."""


class SimulateBackend(TrainingBackend):
    """Time-driven fake training; ends as the job's `JobScript` says."""

    name = "simulate"

    def __init__(self, seconds_per_epoch: float = 1.0, pending_seconds: float = 0.0) -> None:
        self.seconds_per_epoch = seconds_per_epoch
        self.pending_seconds = pending_seconds

    def start(self, job: Job) -> None:
        with job.lock:
            job.started_at = time.monotonic()
            job.set_status("pending", "job queued")

    def status(self, job: Job) -> dict[str, Any]:
        with job.lock:
            if job.status not in TERMINAL:
                self._advance(job)
            return job.status_body()

    def _advance(self, job: Job) -> None:
        elapsed = time.monotonic() - job.started_at - self.pending_seconds
        if elapsed < 0:
            return
        if job.status in ("created", "pending"):
            job.set_status("running", "training started")
        epochs = job.epochs
        done = min(epochs, int(elapsed / self.seconds_per_epoch))
        script = job.script
        stop_at = epochs if script.outcome == "completed" else min(epochs, script.fail_after_epochs)
        done = min(done, stop_at)
        for epoch in range(job.epochs_completed + 1, done + 1):
            job.epochs_completed = epoch
            job.steps_completed = epoch * 10
            job.steps_per_epoch = 10
            job.train_loss = round(0.693 * math.exp(-0.5 * epoch), 6)
            job.val_loss = round(0.693 * math.exp(-0.4 * epoch), 6)
            job.add_metric("train_loss", job.train_loss)
            job.add_metric("val_loss", job.val_loss)
        job.percentage_done = 100.0 * job.epochs_completed / epochs
        finished = elapsed >= stop_at * self.seconds_per_epoch
        if not finished:
            return
        if script.outcome == "completed":
            job.set_status("completed", "training completed")
        elif script.outcome == "failed":
            job.set_status("failed", "training failed", script.message)
        else:
            job.set_status("cancelled", "job cancelled on the server", script.message)

    def cancel(self, job: Job) -> None:
        with job.lock:
            if job.status not in TERMINAL:
                job.set_status("cancelled", "cancelled by user request")


def _default_train_fn() -> TrainFn:
    """dpojax's own training loop (imported lazily: it pulls in jax)."""
    from dpojax.customizer_server.training import train_job

    return train_job


class DpojaxBackend(TrainingBackend):
    """Runs jobs with a dpojax `TrainFn` on the uploaded pairs: at most `max_running` at a time
    (worker threads), up to `max_queued` more waiting in order (`pending`); a create beyond that
    is refused with `BackendBusy` (the server answers 429).

    `model_map` maps a job's `config` (exact, or the part before `@`) to a local HF model dir.
    """

    name = "dpojax"

    def __init__(
        self,
        model_map: Mapping[str, str | Path],
        train_fn: TrainFn | None = None,
        *,
        max_running: int = 1,
        max_queued: int = 16,
    ) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        self.train_fn = train_fn if train_fn is not None else _default_train_fn()
        self.model_map = {k: Path(v) for k, v in model_map.items()}
        self.max_running, self.max_queued = max_running, max_queued
        self._cancel: dict[str, threading.Event] = {}
        self._queue: collections.deque[Job] = collections.deque()
        self._running = 0
        self._workers: list[threading.Thread] = []
        self._cond = threading.Condition()

    def model_dir(self, config: str) -> Path | None:
        for key in (config, config.split("@", 1)[0]):
            if key in self.model_map:
                return self.model_map[key]
        return None

    def validate(self, job: Job) -> None:
        if self.model_dir(job.config) is None:
            known = ", ".join(sorted(self.model_map)) or "none"
            raise ValueError(f"unknown customization config {job.config!r} (known: {known})")
        if job.train_path is None or not job.train_path.is_file():
            raise ValueError(
                f"dataset {job.dataset} has no training/training_file.jsonl in the Datastore"
            )
        check_batch_size(job)

    def start(self, job: Job) -> None:
        """Queues `job`; `BackendBusy` when `max_queued` jobs are waiting already."""
        job.model_dir = self.model_dir(job.config)
        with self._cond:
            if len(self._queue) >= self.max_queued:
                raise BackendBusy(
                    f"{len(self._queue)} jobs are queued and {self._running} running (the "
                    f"server's limit); retry later or cancel one"
                )
            self._cancel[job.id] = threading.Event()
            with job.lock:
                job.started_at = time.monotonic()
                ahead = len(self._queue) + self._running
                job.set_status("pending", f"job queued ({ahead} ahead)")
            self._queue.append(job)
            if len(self._workers) < self.max_running:
                worker = threading.Thread(
                    target=self._work, name=f"dpojax-worker-{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
            self._cond.notify()

    def _work(self) -> None:
        """A worker thread: runs queued jobs one after another."""
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
                self._running += 1
            try:
                self._run(job, self._cancel[job.id])
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def _callback(self, job: Job, stop: threading.Event) -> ProgressCallback:
        def report(update: Mapping[str, Any]) -> None:
            if stop.is_set():
                raise JobCancelled(job.id)
            with job.lock:
                if "steps_per_epoch" in update:
                    job.steps_per_epoch = int(update["steps_per_epoch"])
                if "steps_completed" in update:
                    job.steps_completed = int(update["steps_completed"])
                if "epochs_completed" in update:
                    job.epochs_completed = int(update["epochs_completed"])
                for key in METRIC_KEYS:
                    if update.get(key) is not None:
                        value = float(update[key])
                        job.add_metric(key, value)
                        if key in ("train_loss", "val_loss"):
                            setattr(job, key, value)
                total = update.get("total_steps")
                if total:
                    job.percentage_done = min(100.0, 100.0 * job.steps_completed / float(total))
                else:
                    job.percentage_done = min(100.0, 100.0 * job.epochs_completed / job.epochs)
                job.updated_at = now_iso()

        return report

    def _run(self, job: Job, stop: threading.Event) -> None:
        """Runs one job to a terminal status, whatever happens (no validation file, a training
        error, a cancel)."""
        try:
            with job.lock:
                if stop.is_set() or job.status in TERMINAL:
                    if job.status not in TERMINAL:
                        job.set_status("cancelled", "cancelled by user request")
                    return
                job.set_status("running", "training started")
            if not (job.model_dir and job.train_path and job.output_dir):
                raise RuntimeError("the job has no model or no training file")
            job.output_dir.mkdir(parents=True, exist_ok=True)
            self.train_fn(
                job.model_dir,
                job.train_path,
                job.val_path,
                job.output_dir,
                dict(job.hyperparameters),
                self._callback(job, stop),
            )
        except JobCancelled:
            with job.lock:
                job.set_status("cancelled", "cancelled by user request")
            return
        except BaseException as exc:  # noqa: BLE001 - the job must end, whatever it raised
            with job.lock:
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                job.set_status("failed", f"training failed: {exc}", detail)
            return
        with job.lock:
            if stop.is_set():
                job.set_status("cancelled", "cancelled by user request")
                return
            job.percentage_done = 100.0
            job.epochs_completed = max(job.epochs_completed, job.epochs)
            job.set_status("completed", f"training completed; model written to {job.output_dir}")

    def status(self, job: Job) -> dict[str, Any]:
        with job.lock:
            return job.status_body()

    def cancel(self, job: Job) -> None:
        """A queued job ends `cancelled` at once; a running one is `cancelling` until its next
        progress report (within one training step)."""
        stop = self._cancel.get(job.id)
        if stop is not None:
            stop.set()
        with self._cond:
            queued = job in self._queue
            if queued:
                self._queue.remove(job)
        with job.lock:
            if job.status in TERMINAL:
                return
            if queued:
                job.set_status("cancelled", "cancelled by user request (before it started)")
            else:
                job.set_status("cancelling", "cancellation requested")

    def join(self, timeout: float | None = None) -> None:
        """Wait until no job is queued or running (for tests and shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._cond.wait(left)
