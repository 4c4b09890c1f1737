"""Customizer routes of the local server: customization configs and jobs (create, list, get,
status, cancel). A job is validated, handed to the training backend and tracked in the store."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dpojax.customizer.server.backends import TERMINAL, Job, TrainingBackend
from dpojax.customizer.server.common import error, json_body
from dpojax.customizer.server.faults import FaultInjector
from dpojax.customizer.server.store import Store

FINETUNING_TYPES = ("lora", "lora_merged", "all_weights")
TRAINING_TYPES = ("sft", "dpo", "distillation", "grpo")
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
    async def create_job(request: Request):
        body = await json_body(request)
        key = request.headers.get("idempotency-key")
        with store.lock:
            if key and key in store.idempotency:
                return job_json(store.jobs[store.idempotency[key]])
        config = body.get("config")
        if isinstance(config, dict):
            config = config.get("name")
        dataset = body.get("dataset")
        if isinstance(dataset, str):
            ns, _, name = dataset.rpartition("/")
            dataset = {"namespace": ns or "default", "name": name}
        hp = body.get("hyperparameters")
        problems = []
        if not isinstance(config, str) or not config:
            problems.append("'config' must name a customization config")
        if not isinstance(dataset, dict) or not dataset.get("name"):
            problems.append("'dataset' must be {name, namespace}")
        if not isinstance(hp, dict):
            problems.append("'hyperparameters' is required")
        else:
            if hp.get("finetuning_type") not in FINETUNING_TYPES:
                problems.append(
                    f"hyperparameters.finetuning_type must be one of {FINETUNING_TYPES}"
                )
            if hp.get("training_type", "sft") not in TRAINING_TYPES:
                problems.append(f"hyperparameters.training_type must be one of {TRAINING_TYPES}")
        if problems:
            return error(422, "; ".join(problems))
        job_id = f"cust-{uuid.uuid4().hex[:22]}"
        ns = body.get("namespace") or "default"
        base = config.split("@", 1)[0].replace("/", "-")
        model_name = body.get("output_model") or (
            f"{ns}/{base}-{dataset['name']}-{hp['finetuning_type']}@{job_id}"
        )
        job = Job(
            id=job_id,
            namespace=ns,
            config=config,
            dataset={"name": dataset["name"], "namespace": dataset.get("namespace") or "default"},
            hyperparameters=hp,
            output_model=model_name,
            script=faults.job_script,
        )
        job.train_path, job.val_path = store.dataset_files(job.dataset)
        if job.train_path is None:
            ds = f"{job.dataset['namespace']}/{job.dataset['name']}"
            return error(422, f"dataset {ds} not found or has no training/training_file.jsonl")
        job.output_dir = store.root / "models" / job_id
        try:
            backend.validate(job)
        except ValueError as exc:
            return error(422, str(exc))
        with store.lock:
            if key and key in store.idempotency:  # a concurrent duplicate won the race
                return job_json(store.jobs[store.idempotency[key]])
            store.jobs[job_id] = job
            store.job_payloads[job_id] = body
            if key:
                store.idempotency[key] = job_id
        backend.start(job)
        return job_json(job)

    def get_job_or_404(job_id: str) -> Job | JSONResponse:
        job = store.jobs.get(job_id)
        return job if job is not None else error(404, f"customization job {job_id!r} not found")

    @app.get("/v1/customization/jobs")
    async def list_jobs():
        return {"object": "list", "data": [job_json(j) for j in list(store.jobs.values())]}

    @app.get("/v1/customization/jobs/{job_id}")
    async def get_job(job_id: str):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        backend.status(job)
        return job_json(job)

    @app.get("/v1/customization/jobs/{job_id}/status")
    async def job_status(job_id: str):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        body = backend.status(job)
        if job.script.omit_percentage_done:
            body.pop("percentage_done", None)
        return body

    @app.post("/v1/customization/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str):
        job = get_job_or_404(job_id)
        if isinstance(job, JSONResponse):
            return job
        if job.status not in TERMINAL:
            backend.cancel(job)
        return job_json(job)
