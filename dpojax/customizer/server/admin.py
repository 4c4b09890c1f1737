"""Test-only routes of the local server (`--enable-admin`): faults, state, the request log."""

from __future__ import annotations

from fastapi import FastAPI, Request

from dpojax.customizer.server.common import error, json_body
from dpojax.customizer.server.faults import FaultInjector
from dpojax.customizer.server.store import Store


def add_admin_routes(app: FastAPI, store: Store, faults: FaultInjector) -> None:
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
