"""The FastAPI app of the local Customizer server: the REST surface of reference §E.

Entity Store / Customizer / Deployment (`entity_host`): `/v1/namespaces`, `/v1/datasets`,
`/v1/customization/jobs[/{id}[/status|/cancel]]`, `/v1/customization/configs`,
`/v1/deployment/configs`, `/v1/deployment/model-deployments` (paginated).
Datastore (`datastore_host`): `/v1/datastore/namespaces` (form body) and the HF Hub subset under
`/v1/hf` that huggingface_hub's `create_repo` / `upload_file` / `repo_info` / downloads use.
Test-only (with `admin=True`): `/_admin/faults`, `/_admin/state`, `/_admin/requests`,
`/_admin/deployments`.

Every answer carries at least the fields §E.1 lists as the clients' minimum: a 409 on create
repo still has `url`; preupload answers `shouldIgnore`; commits answer a relative `commitUrl`;
statuses have a numeric `percentage_done` (unless a fault removes it); duplicates answer 409 with
`x-should-retry: false` so the SDK does not retry them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dpojax.customizer.backends import TERMINAL, Job, TrainingBackend, now_iso
from dpojax.customizer.faults import FaultInjector
from dpojax.customizer.server_common import NO_RETRY, BadRequest, error, json_body
from dpojax.customizer.server_datastore import add_datastore_routes
from dpojax.customizer.server_store import Store

FINETUNING_TYPES = ("lora", "lora_merged", "all_weights")
TRAINING_TYPES = ("sft", "dpo", "distillation", "grpo")
MAX_REQUEST_LOG = 10_000


def _auth_summary(value: str | None) -> str:
    """What the request log keeps of an Authorization header (never the token itself)."""
    if value is None:
        return "none"
    scheme, _, token = value.partition(" ")
    if not token.strip():
        return f"{scheme.lower()}-empty"
    return f"{scheme.lower()}:{hashlib.sha256(token.encode()).hexdigest()[:12]}"


class FaultAndLogMiddleware:
    """ASGI middleware: applies fault rules, then logs every request (method, path, status)."""

    def __init__(self, app: Any, faults: FaultInjector, store: Store) -> None:
        self.app, self.faults, self.store = app, faults, store

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        entry: dict[str, Any] = {
            "method": method,
            "path": path,
            "query": scope.get("query_string", b"").decode(),
            "auth": _auth_summary(headers.get("authorization")),
            "time": time.time(),
            "status": None,
            "fault": None,
        }
        with self.store.lock:
            self.store.requests.append(entry)
            if len(self.store.requests) > MAX_REQUEST_LOG:
                del self.store.requests[: len(self.store.requests) - MAX_REQUEST_LOG]
        rule = None if path.startswith("/_admin") else self.faults.pick(method, path)
        if rule is not None:
            entry["fault"] = rule.action
            if rule.action == "delay":
                await asyncio.sleep(rule.delay_seconds)
            elif rule.action == "reset":
                # Start a response and return without finishing it: uvicorn closes the
                # connection, and the client sees the peer drop it mid-response.
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", b"64"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": b"{", "more_body": True})
                entry["status"] = "reset"
                return
            else:
                entry["status"] = rule.status
                response = error(rule.status, rule.message, headers=rule.headers or None)
                await response(scope, receive, send)
                return

        async def logging_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        await self.app(scope, receive, logging_send)


def create_app(
    store: Store,
    backend: TrainingBackend,
    faults: FaultInjector | None = None,
    *,
    admin: bool = False,
    max_page_size: int = 100,
    customization_configs: list[str] | None = None,
) -> FastAPI:
    """The server app over `store` and `backend`; `admin` enables the `/_admin` endpoints."""
    faults = faults or FaultInjector()
    app = FastAPI(title="dpojax local Customizer", docs_url=None, redoc_url=None)
    app.state.store, app.state.backend, app.state.faults = store, backend, faults

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error(422, str(exc))

    @app.get("/health")
    @app.get("/v1/health/live")
    @app.get("/v1/health/ready")
    async def health() -> dict[str, str]:
        return {"status": "healthy", "backend": backend.name}

    # ------------------------------------------------------------------ Entity Store

    @app.post("/v1/namespaces")
    async def create_namespace(request: Request):
        body = await json_body(request)
        ns = body.get("id")
        if not isinstance(ns, str) or not ns:
            return error(422, "field 'id' (the namespace) is required")
        with store.lock:
            if ns in store.namespaces:
                return error(409, f"namespace {ns!r} already exists", NO_RETRY)
            record = {"id": ns, "description": body.get("description"), "created_at": now_iso()}
            store.namespaces[ns] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/namespaces/{ns}")
    async def get_namespace(ns: str):
        record = store.namespaces.get(ns)
        return record if record else error(404, f"namespace {ns!r} not found")

    @app.post("/v1/datasets")
    async def create_dataset(request: Request):
        body = await json_body(request)
        name, ns = body.get("name"), body.get("namespace") or "default"
        if not isinstance(name, str) or not name or not body.get("files_url"):
            return error(422, "fields 'name' and 'files_url' are required")
        with store.lock:
            if (ns, name) in store.datasets:
                return error(409, f"dataset {ns}/{name} already exists", NO_RETRY)
            record = {**body, "namespace": ns, "id": f"dataset-{uuid.uuid4().hex[:12]}"}
            record["created_at"] = now_iso()
            store.datasets[(ns, name)] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/datasets/{ns}/{name}")
    async def get_dataset(ns: str, name: str):
        record = store.datasets.get((ns, name))
        return record if record else error(404, f"dataset {ns}/{name} not found")

    # ------------------------------------------------------------------ Customizer

    def job_json(job: Job) -> dict[str, Any]:
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

    @app.get("/v1/customization/configs")
    async def list_configs():
        names = customization_configs or ["meta/llama-3.2-1b-instruct@v1.0.0+A100"]
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

    # ------------------------------------------------------------------ Deployment

    @app.post("/v1/deployment/configs")
    async def create_deployment_config(request: Request):
        body = await json_body(request)
        name, ns = body.get("name"), body.get("namespace") or "default"
        if not isinstance(name, str) or not name:
            return error(422, "field 'name' is required")
        with store.lock:
            if (ns, name) in store.deployment_configs:
                return error(409, f"deployment config {ns}/{name} already exists", NO_RETRY)
            record = {**body, "name": name, "namespace": ns, "created_at": now_iso()}
            store.deployment_configs[(ns, name)] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/deployment/configs/{ns}/{name}")
    async def get_deployment_config(ns: str, name: str):
        record = store.deployment_configs.get((ns, name))
        return record if record else error(404, f"deployment config {ns}/{name} not found")

    @app.post("/v1/deployment/model-deployments")
    async def create_model_deployment(request: Request):
        body = await json_body(request)
        name, ns = body.get("name"), body.get("namespace") or "default"
        if not isinstance(name, str) or not name:
            return error(422, "field 'name' is required")
        with store.lock:
            if (ns, name) in store.deployments:
                return error(409, f"model deployment {ns}/{name} already exists", NO_RETRY)
        return JSONResponse(store.add_deployment(body), status_code=201)

    @app.get("/v1/deployment/model-deployments")
    async def list_model_deployments(page: int = 1, page_size: int = 10):
        size = max(1, min(page_size, max_page_size))
        with store.lock:
            records = list(store.deployments.values())
        total_pages = max(1, -(-len(records) // size))
        chunk = records[(page - 1) * size : page * size] if page >= 1 else []
        return {
            "object": "list",
            "data": [store.deployment_view(r) for r in chunk],
            "sort": "created_at",
            "pagination": {
                "page": page,
                "page_size": size,
                "current_page_size": len(chunk),
                "total_pages": total_pages,
                "total_results": len(records),
            },
        }

    @app.get("/v1/deployment/model-deployments/{ns}/{name}")
    async def get_model_deployment(ns: str, name: str):
        record = store.deployments.get((ns, name))
        if record is None:
            return error(404, f"model deployment {ns}/{name} not found")
        return store.deployment_view(record)

    add_datastore_routes(app, store)

    if admin:
        _add_admin_routes(app, store, faults)
    app.add_middleware(FaultAndLogMiddleware, faults=faults, store=store)
    return app


def _add_admin_routes(app: FastAPI, store: Store, faults: FaultInjector) -> None:
    """Test-only endpoints: configure faults, read state and the request log, seed deployments."""

    @app.get("/_admin/faults")
    async def get_faults():
        return faults.snapshot()

    @app.post("/_admin/faults")
    async def set_faults(request: Request):
        try:
            faults.configure(await json_body(request))
        except (TypeError, ValueError) as exc:
            return error(422, str(exc))
        return faults.snapshot()

    @app.delete("/_admin/faults")
    async def clear_faults():
        faults.clear()
        return faults.snapshot()

    @app.get("/_admin/state")
    async def state():
        return store.snapshot()

    @app.get("/_admin/requests")
    async def requests():
        with store.lock:
            return {"requests": list(store.requests)}

    @app.post("/_admin/deployments")
    async def seed(request: Request):
        body = await json_body(request)
        count, ns = int(body.get("count", 1)), body.get("namespace") or "other"
        for i in range(count):
            store.add_deployment(
                {"name": f"{body.get('prefix', 'filler')}-{i}", "namespace": ns},
                forced_status=body.get("status"),
            )
        return {"deployments": len(store.deployments)}
