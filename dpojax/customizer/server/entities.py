"""Entity Store routes of the local server: namespaces and dataset registrations."""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dpojax.customizer.server.backends import now_iso
from dpojax.customizer.server.common import NO_RETRY, error, json_body
from dpojax.customizer.server.store import Store


def add_entity_routes(app: FastAPI, store: Store) -> None:
    """`/v1/namespaces` and `/v1/datasets` (create, get)."""

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
