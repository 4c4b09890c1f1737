"""A local NeMo Customizer-compatible server (FastAPI + uvicorn) for tests, dry runs and NAT.

    python -m dpojax.customizer_server --host 127.0.0.1 --port 8000 --backend simulate --root DIR

Serves the Entity Store, Customizer, Deployment and Datastore (HF Hub) endpoints that the
clients use (docs/customizer.md#rest-surface) on one port, so both `entity_host` and
`datastore_host` point at it. Uploaded files are kept under `DIR/datastore/`. `--backend
simulate` advances progress with time and completes; `--backend dpojax` trains each job with
dpojax on the local model that `--model NAME=HF_DIR` names for its customization config.
`--faults FILE` (JSON, see `faults`) injects faults; `--enable-admin` exposes the test-only
`/_admin/*` endpoints.

`serve_in_thread(...)` runs the same server inside a process (tests) and returns a handle with
`url` and `stop()`.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpojax.customizer.client.errors import require_extra
from dpojax.customizer_server.backends import (
    BackendUnavailableError,
    DpojaxBackend,
    SimulateBackend,
    TrainFn,
    TrainingBackend,
)
from dpojax.customizer_server.faults import FaultInjector
from dpojax.customizer_server.guard import DEFAULT_MAX_BODY_BYTES
from dpojax.customizer_server.store import Store

BACKENDS = ("simulate", "dpojax")


def make_backend(
    name: str,
    *,
    seconds_per_epoch: float = 1.0,
    model_map: Mapping[str, str | Path] | None = None,
    train_fn: TrainFn | None = None,
    max_running: int = 1,
    max_queued: int = 16,
) -> TrainingBackend:
    """The backend called `name` (`simulate` or `dpojax`)."""
    if name == "simulate":
        return SimulateBackend(seconds_per_epoch=seconds_per_epoch)
    if name == "dpojax":
        return DpojaxBackend(
            model_map or {}, train_fn=train_fn, max_running=max_running, max_queued=max_queued
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def build_app(
    root: str | Path,
    backend: TrainingBackend,
    *,
    faults: FaultInjector | Mapping[str, Any] | None = None,
    admin: bool = False,
    deployment_ready_seconds: float = 0.5,
    max_page_size: int = 100,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Any:
    """The FastAPI app with a fresh `Store` under `root`."""
    from dpojax.customizer_server.app import create_app

    injector = faults if isinstance(faults, FaultInjector) else FaultInjector()
    if isinstance(faults, Mapping):
        injector.configure(faults)
    store = Store(Path(root), deployment_ready_seconds=deployment_ready_seconds)
    configs = sorted(backend.model_map) if isinstance(backend, DpojaxBackend) else None
    return create_app(
        store,
        backend,
        injector,
        admin=admin,
        max_page_size=max_page_size,
        customization_configs=configs,
        max_body_bytes=max_body_bytes,
    )


@dataclass
class ServerHandle:
    """A server running in a background thread."""

    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def store(self) -> Store:
        return self.app.state.store

    @property
    def faults(self) -> FaultInjector:
        return self.app.state.faults

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(
    root: str | Path,
    backend: TrainingBackend | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    **app_kwargs: Any,
) -> ServerHandle:
    """Start the server on `host:port` (0 = any free port) in a daemon thread, once serving."""
    uvicorn = require_extra("uvicorn")
    app = build_app(root, backend or SimulateBackend(), **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the local Customizer server did not start")
        time.sleep(0.01)
    bound_port = sock.getsockname()[1]
    return ServerHandle(f"http://{host}:{bound_port}", app, server, thread)


def _parse_models(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--model expects NAME=HF_DIR, got {item!r}")
        out[name] = path
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m dpojax.customizer_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", choices=BACKENDS, default="simulate")
    parser.add_argument("--root", required=True, help="folder for uploaded files and outputs")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=HF_DIR",
        help="dpojax backend: map a customization config name to a local HF model folder",
    )
    parser.add_argument("--seconds-per-epoch", type=float, default=1.0)
    parser.add_argument("--deployment-ready-seconds", type=float, default=0.5)
    parser.add_argument("--max-page-size", type=int, default=100)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused (413)",
    )
    parser.add_argument(
        "--max-running-jobs", type=int, default=1, help="dpojax backend: jobs training at once"
    )
    parser.add_argument(
        "--max-queued-jobs",
        type=int,
        default=16,
        help="dpojax backend: jobs waiting; a create beyond them is refused (429)",
    )
    parser.add_argument("--faults", type=Path, help="JSON file: {rules: [...], job: {...}}")
    parser.add_argument("--enable-admin", action="store_true", help="test-only /_admin endpoints")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        backend = make_backend(
            args.backend,
            seconds_per_epoch=args.seconds_per_epoch,
            model_map=_parse_models(args.model),
            max_running=args.max_running_jobs,
            max_queued=args.max_queued_jobs,
        )
    except (BackendUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    faults = json.loads(args.faults.read_text()) if args.faults else None
    uvicorn = require_extra("uvicorn")
    app = build_app(
        args.root,
        backend,
        faults=faults,
        admin=args.enable_admin,
        deployment_ready_seconds=args.deployment_ready_seconds,
        max_page_size=args.max_page_size,
        max_body_bytes=args.max_body_bytes,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
