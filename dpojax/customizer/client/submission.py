"""Submit preference pairs to NeMo Customizer: NAT's adapter flow, with its known faults fixed.

`submit(pairs, settings, workdir=...)`:
1. writes NAT's Customizer JSONL (ordered 80/20 split) under `workdir/dataset/`;
2. creates the namespace in the Entity Store and the Datastore (`create_namespace_if_missing`);
3. creates the dataset repo and uploads `training/training_file.jsonl` and
   `validation/validation_file.jsonl` through huggingface_hub at `{datastore_host}/v1/hf`;
4. registers the dataset and creates the customization job (config, dataset, hyperparameters);
5. polls the job's status to a terminal state (backoff on transient failures, a clean failure
   after `max_consecutive_status_failures`, an overall `training_timeout_seconds`);
6. optionally deploys the output model and waits until the deployment is ready (all pages);
7. writes NAT-compatible run artifacts (`final_metrics.json`, ...; see `artifacts`).

Ctrl-C or SIGTERM while waiting asks the service to cancel the job (`cancel_on_interrupt`:
`ask` prompts on a terminal and cancels otherwise, `always`, `never`); when it is not cancelled,
the message says how to cancel it. Every failure raises a `CustomizerError` subclass whose
`exit_code` tells "the job failed" (10) from "the service could not be reached" (11) and the rest
(see `errors`). Tokens never reach logs or files (see `tokens`).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from dpojax.customizer.client import artifacts as art
from dpojax.customizer.client.auth import Redactor, plain_http_warning, resolve_hf_token
from dpojax.customizer.client.errors import (
    EXIT_OK,
    CustomizerError,
    DeploymentError,
    JobCancelledError,
    JobFailedError,
    RequestRejectedError,
    ServiceUnreachableError,
    SubmitInterrupted,
    TrainingTimeoutError,
)
from dpojax.customizer.client.service import CustomizerService
from dpojax.customizer.client.settings import CustomizerSettings
from dpojax.customizer.client.status import CANCELED, COMPLETED, FAILED, RUNNING, JobStatus
from dpojax.customizer.client.transport import REJECTED, Retrier, classify
from dpojax.data.pair_files import customizer_split, write_customizer_files
from dpojax.data.pairs import PreferencePair
from dpojax.interrupts import Interrupted, StopSignals

log = logging.getLogger("dpojax.customizer")
ConfirmCancel = Callable[[str], bool]


@dataclass
class SubmitResult:
    """What a submission produced; also attached (partially filled) to every raised error."""

    run_id: str
    workdir: Path
    training_file: Path
    validation_file: Path
    num_training: int
    num_validation: int
    dataset_name: str
    repo_id: str
    job_id: str | None = None
    output_model: str | None = None
    status: JobStatus | None = None
    deployment: dict[str, Any] | None = None
    exit_code: int = EXIT_OK
    history: list[JobStatus] = field(default_factory=list, repr=False)

    @property
    def job_metadata(self) -> dict[str, Any]:
        """NAT's `TrainingJobRef.metadata`."""
        return {
            "job_id": self.job_id,
            "output_model": self.output_model,
            "dataset_name": self.dataset_name,
        }


def _ask_on_terminal(job_id: str) -> bool:
    """Prompt on a terminal; without one (or on a second Ctrl-C / EOF) the answer is yes/no."""
    if not sys.stdin or not sys.stdin.isatty():
        return True
    try:
        answer = input(f"\nCancel customization job {job_id} on the server? [Y/n] ")
    except (EOFError, KeyboardInterrupt):
        return False
    return answer.strip().lower() in ("", "y", "yes")


class _Submission:
    """State and steps of one `submit` call."""

    def __init__(
        self,
        settings: CustomizerSettings,
        result: SubmitResult,
        service: CustomizerService,
        artifacts: art.Artifacts,
        collection: list[dict[str, Any]],
        groups: int,
        confirm_cancel: ConfirmCancel | None,
        sleep: Callable[[float], None],
    ) -> None:
        self.s, self.result, self.service, self.artifacts = settings, result, service, artifacts
        self.collection, self.groups = collection, groups
        self.confirm_cancel, self.sleep = confirm_cancel, sleep

    # ------------------------------------------------------------------ outcomes

    def finish(self, status: JobStatus, exit_code: int) -> None:
        """Record the final status and write `final_metrics.json`."""
        self.result.status, self.result.exit_code = status, exit_code
        self.artifacts.final_metrics(
            run_id=self.result.run_id,
            status=status.status,
            message=status.message,
            progress=status.progress,
            collection_history=self.collection,
            total_trajectory_groups=self.groups,
            job_metadata=self.result.job_metadata,
            exit_code=exit_code,
            deployment=self.result.deployment,
        )

    def fail(self, error: CustomizerError, status: JobStatus | None = None) -> CustomizerError:
        """Attach the result, write final metrics, log; return `error` for raising."""
        error.result = self.result
        status = status or JobStatus(FAILED, message=error.message)
        self.finish(status, error.exit_code)
        log.error("%s", error.message)
        return error

    def how_to_cancel(self) -> str:
        url = f"{self.s.entity_host}/v1/customization/jobs/{self.result.job_id}/cancel"
        return f"the job may still be running on the server; to cancel it: curl -X POST {url}"

    # ------------------------------------------------------------------ waiting

    def record(self, status: JobStatus) -> None:
        self.result.history.append(status)
        self.artifacts.status({"job_id": self.result.job_id, **status.to_dict()})

    def wait_for_job(self) -> JobStatus:
        """Poll until a terminal status; raises on timeout or when the service stays away."""
        s, job_id = self.s, self.result.job_id
        assert job_id is not None
        deadline = time.monotonic() + s.training_timeout_seconds
        failures, last_raw = 0, object()
        epochs = s.hyperparameters.epochs
        while True:
            wait = s.poll_interval_seconds
            try:
                details = self.service.job_status(job_id)
            except Exception as exc:
                failure = classify(exc)
                if failure is None:
                    raise
                text = self.service.redactor.text(failure.describe())
                if failure.kind == REJECTED:
                    raise self.fail(
                        RequestRejectedError(
                            f"job {job_id}: status request refused: {text}",
                            status_code=failure.status,
                        )
                    ) from None
                failures += 1
                if failures >= s.max_consecutive_status_failures:
                    message = (
                        f"Error getting status: {text} ({failures} consecutive failures; "
                        f"{self.how_to_cancel()})"
                    )
                    status = JobStatus(FAILED, message=message)
                    self.record(status)
                    raise self.fail(
                        ServiceUnreachableError(
                            f"job {job_id}: the service could not be reached: {message}"
                        ),
                        status,
                    ) from None
                wait = s.poll_interval_seconds * 1.5**failures
                log.warning(
                    "Job %s: status failed (%s), attempt %d/%d; retrying in %.2fs",
                    job_id,
                    text,
                    failures,
                    s.max_consecutive_status_failures,
                    wait,
                )
            else:
                failures = 0
                status = JobStatus.from_details(details, epochs)
                self.record(status)
                if status.raw_status != last_raw:
                    log.info("Job %s: Status -> %r", job_id, status.raw_status)
                    last_raw = status.raw_status
                if status.progress is None:
                    log.info("Job %s: progress not reported (%s)", job_id, status.message)
                else:
                    log.info("Job %s: Progress %.1f%%", job_id, status.progress)
                if status.terminal:
                    return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out()
            self.sleep(min(wait, remaining))
            if time.monotonic() >= deadline:
                self.timed_out()

    def timed_out(self) -> NoReturn:
        """Cancel (with `cancel_on_timeout`) and raise `TrainingTimeoutError`."""
        text = (
            f"job {self.result.job_id} did not finish within {self.s.training_timeout_seconds:g}s"
        )
        status = self._stop_waiting(text, cancel=self.s.cancel_on_timeout)
        raise self.fail(TrainingTimeoutError(status.message), status)

    def _stop_waiting(self, text: str, *, cancel: bool) -> JobStatus:
        """The status recorded when the client stops waiting: the job cancelled (when `cancel`
        and the service accepts), or still running with instructions to cancel it."""
        if cancel and self._cancel():
            status = JobStatus(CANCELED, message=f"{text}; cancellation was requested")
        else:
            status = JobStatus(RUNNING, message=f"{text}; {self.how_to_cancel()}")
        self.record(status)
        return status

    def _cancel(self) -> bool:
        """Ask the service to cancel; False (logged) if that fails."""
        try:
            self.service.cancel_job(self.result.job_id or "")
        except CustomizerError as exc:
            log.error("Could not cancel job %s: %s", self.result.job_id, exc.message)
            return False
        log.warning("Asked the service to cancel job %s", self.result.job_id)
        return True

    def interrupted(self, signal_name: str) -> CustomizerError:
        job_id = self.result.job_id or ""
        mode = self.s.cancel_on_interrupt
        if mode == "ask":
            confirm = self.confirm_cancel or (
                (lambda _: True) if signal_name == "SIGTERM" else _ask_on_terminal
            )
            cancel = confirm(job_id)
        else:
            cancel = mode == "always"
        text = f"interrupted ({signal_name}) while waiting for job {job_id}"
        status = self._stop_waiting(text, cancel=cancel)
        return self.fail(SubmitInterrupted(status.message), status)

    # ------------------------------------------------------------------ deployment

    def deploy(self) -> None:
        output_model = self.result.output_model
        if not output_model:
            log.warning("The job reported no output model; skipping deployment")
            return
        s = self.s
        namespace, name = self.service.deploy(self.result.run_id, output_model)
        log.info("Deploying %s as %s/%s", output_model, namespace, name)
        deadline = time.monotonic() + s.deployment_timeout_seconds
        last_error = ""
        while True:
            try:
                item = self.service.find_deployment(namespace, name)
            except ServiceUnreachableError as exc:
                item, last_error = None, exc.message
                log.warning("Deployment status: %s", exc.message)
            if item is None:
                state = "missing"
            else:
                details = getattr(item, "status_details", None)
                state = str(getattr(details, "status", None) or "unknown").lower()
                self.result.deployment = {
                    "namespace": namespace,
                    "name": name,
                    "model": output_model,
                    "status": state,
                    "description": getattr(details, "description", None),
                    "url": getattr(item, "url", None),
                }
                self.artifacts.deployment(self.result.deployment)
                if state == "ready":
                    log.info("Deployment %s/%s is ready", namespace, name)
                    return
                if state in ("failed", "error"):
                    reason = getattr(details, "description", None) or state
                    raise DeploymentError(f"deployment {namespace}/{name} failed: {reason}")
            if time.monotonic() >= deadline:
                extra = f" (last error: {last_error})" if last_error else ""
                raise DeploymentError(
                    f"deployment {namespace}/{name} was not ready within "
                    f"{s.deployment_timeout_seconds:g}s (last status: {state}){extra}"
                )
            self.sleep(min(s.poll_interval_seconds, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ the flow

    def _record_and_wait(self) -> JobStatus | None:
        """Records the submission and waits for the job (None when not waiting)."""
        s, result, service = self.s, self.result, self.service
        log.info(
            "Submitted customization job %s for run %s. Output model: %s",
            result.job_id,
            result.run_id,
            result.output_model,
        )
        self.artifacts.submission(
            {
                "run_id": result.run_id,
                "backend": art.BACKEND,
                "metadata": result.job_metadata,
                "entity_host": s.entity_host,
                "datastore_host": s.datastore_host,
                "repo_id": result.repo_id,
                "job": service.job_payload(),
                "num_training": result.num_training,
                "num_validation": result.num_validation,
                "settings": s.to_dict(),
            }
        )
        if not s.wait_for_completion:
            result.status = JobStatus(
                RUNNING, message="Training job submitted (not waiting for completion)"
            )
            return None
        log.info("Waiting for training job to complete...")
        return self.wait_for_job()

    def run(self) -> SubmitResult:
        s, result, service = self.s, self.result, self.service
        try:
            if s.create_namespace_if_missing:
                service.ensure_namespaces()
            service.upload_dataset(result.run_id, result.training_file, result.validation_file)
            service.register_dataset(result.run_id)
            result.job_id, result.output_model = service.create_job()
        except CustomizerError as exc:
            raise self.fail(exc) from None
        try:  # from here on a job exists: an interrupt cancels it (or says how to)
            with StopSignals((signal.SIGTERM,), interrupt=True):  # SIGINT raises by itself
                status = self._record_and_wait()
        except KeyboardInterrupt as exc:
            name = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
            raise self.interrupted(name) from None
        if status is None:
            return result
        if status.status == FAILED:
            raise self.fail(
                JobFailedError(f"training job {result.job_id} failed: {status.message}"), status
            )
        if status.status == CANCELED:
            raise self.fail(
                JobCancelledError(f"training job {result.job_id} was cancelled: {status.message}"),
                status,
            )
        if s.deploy_on_completion:
            try:
                with StopSignals((signal.SIGTERM,), interrupt=True):
                    self.deploy()
            except CustomizerError as exc:  # DeploymentError, or the service went away
                raise self.fail(exc, status) from None
            except KeyboardInterrupt:
                text = "interrupted while waiting for the deployment (the model is trained)"
                raise self.fail(SubmitInterrupted(text), status) from None
        self.finish(status, EXIT_OK)
        log.info("Training completed with status: %s", status.status)
        assert status.status == COMPLETED
        return result


def submit(
    pairs: Iterable[PreferencePair],
    settings: CustomizerSettings | Mapping[str, Any],
    *,
    workdir: str | Path,
    run_id: str | None = None,
    collection_history: Sequence[Mapping[str, Any]] | None = None,
    confirm_cancel: ConfirmCancel | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> SubmitResult:
    """Submit `pairs` to NeMo Customizer and (by default) wait for training and deployment.

    `settings`: validated `CustomizerSettings` or a mapping of `customizer.*` keys.
    `collection_history`: NAT-style per-run collection entries for `final_metrics.json`
    (default: one entry describing `pairs`). `confirm_cancel(job_id)`: answers "cancel the job?"
    on Ctrl-C when `cancel_on_interrupt="ask"` (default: a terminal prompt). `environ`: where
    `HF_TOKEN` is read (default `os.environ`). Raises a `CustomizerError` subclass on failure.
    """
    if not isinstance(settings, CustomizerSettings):
        settings = CustomizerSettings.from_mapping(settings)
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no preference pairs to submit")
    workdir = Path(workdir)
    run_id = run_id or f"dpojax_{uuid.uuid4().hex[:8]}"
    token = resolve_hf_token(settings.hf_token, dict(environ) if environ is not None else None)
    redactor = Redactor([token, settings.hf_token])
    artifacts = art.Artifacts(workdir, redactor)
    handler = artifacts.attach_log(log)
    log.addFilter(redactor)
    previous_level = log.level
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        for host in dict.fromkeys((settings.datastore_host, settings.entity_host)):
            warning = plain_http_warning(host, token)
            if warning:
                log.warning("%s", warning)
        train_path, val_path = write_customizer_files(
            pairs,
            workdir / art.DATASET_DIR,
            use_full_message_history=settings.use_full_message_history,
        )
        n_train, n_val = (len(part) for part in customizer_split(pairs))
        log.info("Converted %d DPO items: %d training, %d validation", len(pairs), n_train, n_val)
        result = SubmitResult(
            run_id=run_id,
            workdir=workdir,
            training_file=train_path,
            validation_file=val_path,
            num_training=n_train,
            num_validation=n_val,
            dataset_name=settings.dataset_name,
            repo_id=f"{settings.namespace}/{settings.dataset_name}",
        )
        retrier = Retrier(
            max_retries=settings.max_retries,
            backoff_seconds=settings.retry_backoff_seconds,
            redactor=redactor,
            sleep=sleep,
        )
        service = CustomizerService(settings, token=token, redactor=redactor, retrier=retrier)
        try:
            submission = _Submission(
                settings,
                result,
                service,
                artifacts,
                list(collection_history or art.collection_from_pairs(run_id, pairs)),
                art.trajectory_groups(pairs),
                confirm_cancel,
                sleep,
            )
            return submission.run()
        finally:
            service.close()
    finally:
        log.setLevel(previous_level)
        log.removeFilter(redactor)
        log.removeHandler(handler)
        handler.close()
