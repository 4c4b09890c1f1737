"""Test-only routes of the local server (`--enable-admin`): faults, state, the request log."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from dpojax.customizer_server.common import error
from dpojax.customizer_server.faults import FaultInjector
from dpojax.customizer_server.models import SeedDeploymentsIn
from dpojax.customizer_server.store import Store


def add_admin_routes(app: FastAPI, store: Store, faults: FaultInjector) -> None:
    """Test-only endpoints: configure faults, read state and the request log, seed deployments."""

    @app.get("/_admin/faults")
    async def get_faults():
        return faults.snapshot()

    @app.post("/_admin/faults")
    async def set_faults(body: dict[str, Any]):
        try:
            faults.configure(body)
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
    async def seed(body: SeedDeploymentsIn):
        ns = body.namespace or "other"
        for i in range(body.count):
            store.add_deployment(
                {"name": f"{body.prefix}-{i}", "namespace": ns}, forced_status=body.status
            )
        return {"deployments": len(store.deployments)}
