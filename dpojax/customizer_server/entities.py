"""Entity Store routes of the local server: namespaces and dataset registrations."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from dpojax.customizer_server.backends import now_iso
from dpojax.customizer_server.common import NO_RETRY, error
from dpojax.customizer_server.models import DatasetIn, NamePath, NamespaceIn
from dpojax.customizer_server.store import Store


def add_entity_routes(app: FastAPI, store: Store) -> None:
    """`/v1/namespaces` and `/v1/datasets` (create, get)."""

    @app.post("/v1/namespaces", status_code=201)
    async def create_namespace(body: NamespaceIn):
        ns = body.id
        with store.lock:
            if ns in store.namespaces:
                return error(409, f"namespace {ns!r} already exists", NO_RETRY)
            record = {"id": ns, "description": body.description, "created_at": now_iso()}
            store.namespaces[ns] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/namespaces/{ns}")
    async def get_namespace(ns: NamePath):
        record = store.namespaces.get(ns)
        return record if record else error(404, f"namespace {ns!r} not found")

    @app.post("/v1/datasets", status_code=201)
    async def create_dataset(body: DatasetIn):
        name, ns = body.name, body.namespace or "default"
        with store.lock:
            if (ns, name) in store.datasets:
                return error(409, f"dataset {ns}/{name} already exists", NO_RETRY)
            record = {**body.model_dump(), "namespace": ns}
            record["id"] = f"dataset-{uuid.uuid4().hex[:12]}"
            record["created_at"] = now_iso()
            store.datasets[(ns, name)] = record
        return JSONResponse(record, status_code=201)

    @app.get("/v1/datasets/{ns}/{name}")
    async def get_dataset(ns: NamePath, name: NamePath):
        record = store.datasets.get((ns, name))
        return record if record else error(404, f"dataset {ns}/{name} not found")
