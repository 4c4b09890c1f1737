"""Customizer routes of the local server: customization configs and jobs (create, list, get,
status, cancel). A job is validated, handed to the training backend and tracked in the store."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dpojax.customizer_server.backends import TERMINAL, BackendBusy, Job, TrainingBackend
from dpojax.customizer_server.common import error
from dpojax.customizer_server.faults import FaultInjector
from dpojax.customizer_server.models import IdPath, JobIn
from dpojax.customizer_server.persistence import StoredJob, job_saver
from dpojax.customizer_server.store import Store

DEFAULT_CONFIGS = ["meta/llama-3.2-1b-instruct@v1.0.0+A100"]


def job_json(job: Job) -> dict[str, Any]:
    """The job as the service returns it."""
    with job.lock:
        return {
            "id": job.id,
            "namespace": job.namespace,
            "created_at": job.created_at,
            "updated_at": job.updated_at,
            "config": job.config,
            "dataset": job.dataset,
            "hyperparameters": job.hyperparameters,
            "output_model": job.output_model,
            "status": job.status,
            "status_details": {"status": job.status, "status_logs": list(job.status_logs)},
        }


def _new_job(body: JobIn, faults: FaultInjector) -> StoredJob:
    """A job from a validated create request (not yet started or stored)."""
    config = body.config if isinstance(body.config, str) else body.config.name
    if isinstance(body.dataset, str):
        ns, _, name = body.dataset.rpartition("/")
        dataset = {"namespace": ns or "default", "name": name}
    else:
        dataset = {"namespace": body.dataset.namespace or "default", "name": body.dataset.name}
    hp = body.hyperparameters.model_dump(exclude_unset=True)
    job_id = f"cust-{uuid.uuid4().hex[:22]}"
    ns = body.namespace or "default"
    base = config.split("@", 1)[0].replace("/", "-")
    model_name = body.output_model or (
        f"{ns}/{base}-{dataset['name']}-{hp['finetuning_type']}@{job_id}"
    )
    return StoredJob(
        id=job_id,
        namespace=ns,
        config=config,
        dataset=dataset,
        hyperparameters=hp,
        output_model=model_name,
        script=faults.job_script,
        payload=body.model_dump(exclude_unset=True),
    )


def add_job_routes(
    app: FastAPI,
    store: Store,
    backend: TrainingBackend,
    faults: FaultInjector,
    customization_configs: list[str] | None,
) -> None:
    """`/v1/customization/configs` and `/v1/customization/jobs[/{id}[/status|/cancel]]`."""

    @app.get("/v1/customization/configs")
    async def list_configs():
        names = customization_configs or DEFAULT_CONFIGS
        data = [{"name": n.split("@")[0], "id": n, "target": n} for n in names]
        return {"object": "list", "data": data}

    @app.post("/v1/customization/jobs")
    async def create_job(body: JobIn, request: Request):
        key = request.headers.get("idempotency-key")
        with store.lock:
            if key and key in store.idempotency:
                return job_json(store.jobs[store.idempotency[key]])
        job = _new_job(body, faults)
        job.on_change = job_saver(store)  # from its first status on, the job is on disk
        job.train_path, job.val_path = store.snapshot_dataset(job.dataset, job.id)
        if job.train_path is None:
            store.drop_snapshot(job.id)
            ds = f"{job.dataset['namespace']}/{job.dataset['name']}"
            return error(422, f"dataset {ds} not found or has no training/training_file.jsonl")
        job.output_dir = store.root / "models" / job.id
        try:
            backend.validate(job)
        except ValueError as exc:
            store.drop_snapshot(job.id)
            return error(422, str(exc))
        with store.lock:
            if key and key in store.idempotency:  # a concurrent duplicate won the race
                store.drop_snapshot(job.id)
                return job_json(store.jobs[store.idempotency[key]])
            try:
                backend.start(job)
            except BackendBusy as exc:
                store.drop_snapshot(job.id)
                return error(429, str(exc), {"retry-after": "30"})
            store.jobs[job.id] = job
            store.job_payloads[job.id] = job.payload
            if key:
                store.idempotency[key] = job.id
        return job_json(job)

    def get_job_or_404(job_id: str) -> Job | JSONResponse:
        job = store.jobs.get(job_id)
        return job if job is not None else error(404, f"customization job {job_id!r} not found")

    @app.get("/v1/customization/jobs")
    async def list_jobs():
        return {"object": "list", "data": [job_json(j) for j in list(store.jobs.values())]}

    @app.get("/v1/customization/jobs/{job_id}")
    async def get_job(job_id: IdPath):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        backend.status(job)
        return job_json(job)

    @app.get("/v1/customization/jobs/{job_id}/status")
    async def job_status(job_id: IdPath):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        body = backend.status(job)
        if job.script.omit_percentage_done:
            body.pop("percentage_done", None)
        return body

    @app.post("/v1/customization/jobs/{job_id}/cancel")
    async def cancel_job(job_id: IdPath):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        if job.status not in TERMINAL:
            backend.cancel(job)
        return job_json(job)
