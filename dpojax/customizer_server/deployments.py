"""Deployment routes of the local server: deployment configs and model deployments (paginated
lists, as the real service pages them)."""

from __future__ import annotations

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from dpojax.customizer_server.backends import now_iso
from dpojax.customizer_server.common import NO_RETRY, error
from dpojax.customizer_server.models import DeploymentConfigIn, ModelDeploymentIn, NamePath
from dpojax.customizer_server.store import Store

MAX_PAGE = 1_000_000


def add_deployment_routes(app: FastAPI, store: Store, max_page_size: int) -> None:
    """`/v1/deployment/configs` and `/v1/deployment/model-deployments`."""

    @app.post("/v1/deployment/configs", status_code=201)
    async def create_deployment_config(body: DeploymentConfigIn):
        name, ns = body.name, body.namespace or "default"
        with store.lock:
            if (ns, name) in store.deployment_configs:
                return error(409, f"deployment config {ns}/{name} already exists", NO_RETRY)
            record = {**body.model_dump(), "name": name, "namespace": ns, "created_at": now_iso()}
            store.deployment_configs[(ns, name)] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/deployment/configs/{ns}/{name}")
    async def get_deployment_config(ns: NamePath, name: NamePath):
        record = store.deployment_configs.get((ns, name))
        return record if record else error(404, f"deployment config {ns}/{name} not found")

    @app.post("/v1/deployment/model-deployments", status_code=201)
    async def create_model_deployment(body: ModelDeploymentIn):
        name, ns = body.name, body.namespace or "default"
        with store.lock:
            if (ns, name) in store.deployments:
                return error(409, f"model deployment {ns}/{name} already exists", NO_RETRY)
            view = store.add_deployment(body.model_dump())
        return JSONResponse(view, status_code=201)

    @app.get("/v1/deployment/model-deployments")
    async def list_model_deployments(
        page: int = Query(1, ge=1, le=MAX_PAGE), page_size: int = Query(10, ge=1, le=MAX_PAGE)
    ):
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
    async def get_model_deployment(ns: NamePath, name: NamePath):
        record = store.deployments.get((ns, name))
        if record is None:
            return error(404, f"model deployment {ns}/{name} not found")
        return store.deployment_view(record)
