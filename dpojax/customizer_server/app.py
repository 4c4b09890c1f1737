"""The FastAPI app of the local Customizer server: the REST surface in docs/customizer.md#rest-surface.

Entity Store / Customizer / Deployment (`entity_host`): `/v1/namespaces`, `/v1/datasets`,
`/v1/customization/jobs[/{id}[/status|/cancel]]`, `/v1/customization/configs`,
`/v1/deployment/configs`, `/v1/deployment/model-deployments` (paginated).
Datastore (`datastore_host`): `/v1/datastore/namespaces` (form body) and the HF Hub subset under
`/v1/hf` that huggingface_hub's `create_repo` / `upload_file` / `repo_info` / downloads use.
Test-only (with `admin=True`): `/_admin/faults`, `/_admin/state`, `/_admin/requests`,
`/_admin/deployments`.

With a token (`access`), every request but the health probes needs `Authorization: Bearer
<token>`. Every request that changed something has its state saved under the root before its
answer leaves (`persistence`).

Every answer carries at least the fields the clients need (docs/customizer.md#rest-surface): a 409 on create
repo still has `url`; preupload answers `shouldIgnore`; commits answer a relative `commitUrl`;
statuses have a numeric `percentage_done` (unless a fault removes it); duplicates answer 409 with
`x-should-retry: false` so the SDK does not retry them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from dpojax.customizer_server.access import TokenAuth
from dpojax.customizer_server.admin import add_admin_routes
from dpojax.customizer_server.backends import TrainingBackend
from dpojax.customizer_server.common import error, validation_message
from dpojax.customizer_server.datastore import add_datastore_routes
from dpojax.customizer_server.deployments import add_deployment_routes
from dpojax.customizer_server.entities import add_entity_routes
from dpojax.customizer_server.faults import FaultInjector
from dpojax.customizer_server.guard import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    RequestGuard,
)
from dpojax.customizer_server.jobs import add_job_routes
from dpojax.customizer_server.persistence import save_entities
from dpojax.customizer_server.store import Store

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


class SaveStateMiddleware:
    """ASGI middleware: after a request that may have changed something (not GET, HEAD or
    OPTIONS) and succeeded, the store's state is written under its root before the answer goes
    out, so an answered create survives a restart."""

    def __init__(self, app: Any, store: Store) -> None:
        self.app, self.store = app, store

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return

        async def saving_send(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                save_entities(self.store)
            await send(message)

        await self.app(scope, receive, saving_send)


def create_app(
    store: Store,
    backend: TrainingBackend,
    faults: FaultInjector | None = None,
    *,
    admin: bool = False,
    max_page_size: int = 100,
    customization_configs: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    token: str | None = None,
) -> FastAPI:
    """The server app over `store` and `backend`; `admin` enables the `/_admin` endpoints;
    `token` makes every request but the health probes need it."""
    faults = faults or FaultInjector()
    app = FastAPI(title="dpojax local Customizer", docs_url=None, redoc_url=None)
    app.state.store, app.state.backend, app.state.faults = store, backend, faults

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, validation_message(exc.errors()))

    @app.get("/health")
    @app.get("/v1/health/live")
    @app.get("/v1/health/ready")
    async def health() -> dict[str, str]:
        return {"status": "healthy", "backend": backend.name}

    add_entity_routes(app, store)
    add_job_routes(app, store, backend, faults, customization_configs)
    add_deployment_routes(app, store, max_page_size)
    add_datastore_routes(app, store)
    if admin:
        add_admin_routes(app, store, faults)
    # Added innermost first: the request log and faults see every request, then the token is
    # checked, then (after the answer) the state is saved, and the guard bounds and checks the
    # body before any route (docs/customizer.md#request-validation).
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, body_timeout=body_timeout)
    app.add_middleware(SaveStateMiddleware, store=store)
    if token is not None:
        app.add_middleware(TokenAuth, token=token)
    app.add_middleware(FaultAndLogMiddleware, faults=faults, store=store)
    return app
