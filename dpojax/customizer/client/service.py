"""The REST calls of a Customizer submission, made with the real clients (docs/customizer.md#rest-surface).

- Entity Store, Customizer and Deployment APIs: the `nemo-microservices` SDK at `entity_host`
  (built with `max_retries=0`; `transport.Retrier` does the bounded retries), sending the token
  as `Authorization: Bearer` when there is one (the local server needs it when it has a token).
- Datastore repo and uploads: `huggingface_hub.HfApi` at `{datastore_host}/v1/hf`, with the token,
  or with `token=False` when there is none (no empty `Bearer` header, no cached machine token).
- Datastore namespace: a form-encoded POST with httpx.

Differences from NAT: create calls treat 409 as "exists" without the SDK's 1.3 s of retries;
the job create carries an `Idempotency-Key` so a retried create cannot make a second job; the
deployment list is read across all pages.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from dpojax.customizer.client.auth import Redactor, bearer_headers
from dpojax.customizer.client.errors import RequestRejectedError, require_extra
from dpojax.customizer.client.settings import CustomizerSettings
from dpojax.customizer.client.transport import Retrier
from dpojax.data.pair_files import TRAINING_FILE, VALIDATION_FILE

log = logging.getLogger("dpojax.customizer")
MAX_DEPLOYMENT_PAGES = 1000
DEPLOYMENT_PAGE_SIZE = 100


class CustomizerService:
    """One Customizer deployment (Entity Store + Datastore) as seen by a submitter."""

    def __init__(
        self,
        settings: CustomizerSettings,
        *,
        token: str | None,
        redactor: Redactor,
        retrier: Retrier,
    ) -> None:
        nm = require_extra("nemo_microservices")
        hub = require_extra("huggingface_hub")
        self._httpx = require_extra("httpx")
        self.settings = settings
        self.redactor = redactor
        self.retrier = retrier
        self._token = token
        self.sdk = nm.NeMoMicroservices(
            base_url=settings.entity_host,
            max_retries=0,
            timeout=settings.request_timeout_seconds,
            default_headers=bearer_headers(token),
        )
        self.hf_endpoint = f"{settings.datastore_host}/v1/hf"
        self.hf = hub.HfApi(endpoint=self.hf_endpoint, token=token if token else False)

    @property
    def repo_id(self) -> str:
        return f"{self.settings.namespace}/{self.settings.dataset_name}"

    def close(self) -> None:
        self.sdk.close()

    # ------------------------------------------------------------------ namespaces

    def ensure_namespaces(self) -> None:
        """Create the namespace in the Entity Store and the Datastore (409 = exists)."""
        ns = self.settings.namespace
        self._optional(
            "create Entity Store namespace",
            lambda: self.sdk.namespaces.create(id=ns, description=f"dpojax namespace: {ns}"),
        )
        self._optional("create Datastore namespace", lambda: self._datastore_namespace(ns))

    def _optional(self, what: str, fn: Any) -> None:
        """A create call whose refusal (e.g. 403 on an existing namespace) is only a warning, as
        in NAT; a 409 means it exists; an unreachable service still raises."""
        try:
            self.retrier.call(what, fn, conflict_ok=True)
        except RequestRejectedError as exc:
            log.warning("%s (continuing)", exc.message)

    def _datastore_namespace(self, ns: str) -> None:
        response = self._httpx.post(
            f"{self.settings.datastore_host}/v1/datastore/namespaces",
            data={"namespace": ns},
            headers=bearer_headers(self._token),
            timeout=self.settings.request_timeout_seconds,
        )
        if response.status_code == 422:  # NAT's reading: an older Datastore's "exists"
            log.info("Datastore namespace %s: already exists (422)", ns)
            return
        response.raise_for_status()

    # ------------------------------------------------------------------ dataset

    def upload_dataset(self, run_id: str, training: Path, validation: Path) -> str:
        """Create the dataset repo and upload both files, one commit each (as NAT does).

        Each upload is retried on its own, so a failure on the second never re-sends the first.
        """
        repo_id = self.repo_id
        self.retrier.call(
            "create dataset repo",
            lambda: self.hf.create_repo(repo_id, repo_type="dataset", exist_ok=True),
            conflict_ok=True,
        )
        for local, remote, label in (
            (training, TRAINING_FILE, "Training"),
            (validation, VALIDATION_FILE, "Validation"),
        ):
            self.retrier.call(
                f"upload {remote}",
                lambda local=local, remote=remote, label=label: self.hf.upload_file(
                    path_or_fileobj=str(local),
                    path_in_repo=remote,
                    repo_id=repo_id,
                    repo_type="dataset",
                    revision="main",
                    commit_message=f"{label} file for run {run_id}",
                ),
            )
            log.info("Uploaded %s to %s/%s", remote, self.hf_endpoint, repo_id)
        return repo_id

    def register_dataset(self, run_id: str) -> None:
        """Register the repo as an Entity Store dataset (409 = already registered)."""
        s = self.settings
        self._optional(
            "register dataset",
            lambda: self.sdk.datasets.create(
                name=s.dataset_name,
                namespace=s.namespace,
                files_url=f"hf://datasets/{self.repo_id}",
                description=f"dpojax DPO training dataset for run {run_id}",
            ),
        )

    # ------------------------------------------------------------------ job

    def job_payload(self) -> dict[str, Any]:
        """The `POST /v1/customization/jobs` body NAT sends."""
        s = self.settings
        return {
            "config": s.customization_config,
            "dataset": {"name": s.dataset_name, "namespace": s.namespace},
            "hyperparameters": s.hyperparameters.to_payload(),
        }

    def create_job(self, idempotency_key: str | None = None) -> tuple[str, str | None]:
        """Create the customization job; returns `(job_id, output_model)`."""
        key = idempotency_key or uuid.uuid4().hex
        payload = self.job_payload()
        job = self.retrier.call(
            "create customization job",
            lambda: self.sdk.customization.jobs.create(
                **payload, extra_headers={"Idempotency-Key": key}
            ),
        )
        job_id = getattr(job, "id", None)
        if not job_id:
            raise RequestRejectedError("the service created a job but returned no job id")
        return job_id, getattr(job, "output_model", None)

    def job_status(self, job_id: str) -> Any:
        """One `GET .../status` with no retry (the wait loop counts failures itself)."""
        return self.sdk.customization.jobs.status(job_id)

    def cancel_job(self, job_id: str) -> None:
        """Ask the service to cancel the job."""
        self.retrier.call(
            "cancel customization job", lambda: self.sdk.customization.jobs.cancel(job_id)
        )

    # ------------------------------------------------------------------ deployment

    def deploy(self, run_id: str, output_model: str) -> tuple[str, str]:
        """Create the deployment config and the model deployment; returns `(namespace, name)`."""
        s, dc = self.settings, self.settings.deployment_config
        config_name = f"dpojax-deploy-config-{run_id}"
        cfg = self.retrier.call(
            "create deployment config",
            lambda: self.sdk.deployment.configs.create(
                name=config_name,
                namespace=s.namespace,
                description=dc.description,
                model=output_model,
                nim_deployment={
                    "image_name": dc.image_name,
                    "image_tag": dc.image_tag,
                    "gpu": dc.gpu,
                },
            ),
            conflict_ok=True,
        )
        cfg_ns = getattr(cfg, "namespace", None) or s.namespace
        cfg_ref = f"{cfg_ns}/{getattr(cfg, 'name', None) or config_name}"
        name = dc.deployment_name or f"dpojax-deployment-{run_id}"
        self.retrier.call(
            "create model deployment",
            lambda: self.sdk.deployment.model_deployments.create(
                name=name, namespace=s.namespace, description=dc.description, config=cfg_ref
            ),
            conflict_ok=True,
        )
        return s.namespace, name

    def find_deployment(self, namespace: str, name: str) -> Any | None:
        """The deployment `namespace/name`, searched across every page of the list."""
        page, seen = 1, set()
        while page <= MAX_DEPLOYMENT_PAGES:
            result = self.retrier.call(
                "list model deployments",
                lambda page=page: self.sdk.deployment.model_deployments.list(
                    page=page, page_size=DEPLOYMENT_PAGE_SIZE
                ),
            )
            data = list(getattr(result, "data", None) or [])
            keys = {(getattr(i, "namespace", None), getattr(i, "name", None)) for i in data}
            for item in data:
                if (getattr(item, "namespace", None), getattr(item, "name", None)) == (
                    namespace,
                    name,
                ):
                    return item
            pagination = getattr(result, "pagination", None)
            total_pages = getattr(pagination, "total_pages", None)
            if not data or keys <= seen or (total_pages is not None and page >= total_pages):
                return None  # the last page (or a server that ignores `page`)
            seen |= keys
            page += 1
        return None
