"""A local NeMo Customizer-compatible server (FastAPI + uvicorn) for tests, dry runs and NAT.

    python -m dpojax.customizer_server --host 127.0.0.1 --port 8000 --backend simulate --root DIR

Serves the Entity Store, Customizer, Deployment and Datastore (HF Hub) endpoints that the
clients use (docs/customizer.md#rest-surface) on one port, so both `entity_host` and
`datastore_host` point at it. Uploaded files are kept under `DIR/datastore/`. `--backend
simulate` advances progress with time and completes; `--backend dpojax` trains each job with
dpojax on the local model that `--model NAME=HF_DIR` names for its customization config.
`--faults FILE` (JSON, see `faults`) injects faults; `--enable-admin` exposes the test-only
`/_admin/*` endpoints.

`--token-file PATH` or `DPOJAX_SERVER_TOKEN` sets the bearer token every request needs; without
one the server listens on loopback only (`access`). Slow or unfinished requests time out
(`deadlines`, `--header-timeout-seconds`, `--body-timeout-seconds`). Jobs, datasets and the rest
of the state are kept under `DIR` across restarts (`persistence`).

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
from dpojax.customizer_server.access import (
    TOKEN_ENV,
    AccessError,
    check_listen,
    check_token,
    resolve_server_token,
)
from dpojax.customizer_server.backends import (
    BackendUnavailableError,
    DpojaxBackend,
    SimulateBackend,
    TrainFn,
    TrainingBackend,
)
from dpojax.customizer_server.deadlines import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE,
    MAX_HEADER_BYTES,
    protocol_class,
)
from dpojax.customizer_server.faults import FaultInjector
from dpojax.customizer_server.guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from dpojax.customizer_server.persistence import StateError, load_state
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
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    token: str | None = None,
) -> Any:
    """The FastAPI app with a `Store` under `root`, holding what an earlier server left there
    (`persistence.load_state`; `StateError` for a state file it cannot read)."""
    from dpojax.customizer_server.app import create_app

    injector = faults if isinstance(faults, FaultInjector) else FaultInjector()
    if isinstance(faults, Mapping):
        injector.configure(faults)
    if token is not None:
        check_token(token, "token")
    store = Store(Path(root), deployment_ready_seconds=deployment_ready_seconds)
    load_state(store)
    configs = sorted(backend.model_map) if isinstance(backend, DpojaxBackend) else None
    return create_app(
        store,
        backend,
        injector,
        admin=admin,
        max_page_size=max_page_size,
        customization_configs=configs,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        token=token,
    )


def uvicorn_config(
    app: Any, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT, **kwargs: Any
) -> Any:
    """uvicorn's config for `app`: h11 with the header deadline (`deadlines`), a bounded
    header size and keep-alive."""
    uvicorn = require_extra("uvicorn")
    return uvicorn.Config(
        app,
        http=protocol_class(header_timeout),
        timeout_keep_alive=DEFAULT_KEEP_ALIVE,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **kwargs,
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
        """Stops serving; from now on nothing is written to the state files (as when the
        process ends), so a server started again on the same root reads the state as it was."""
        self.store.closed = True
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
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    token: str | None = None,
    **app_kwargs: Any,
) -> ServerHandle:
    """Start the server on `host:port` (0 = any free port) in a daemon thread, once serving;
    beyond loopback only with a `token` (`access.check_listen`)."""
    check_listen(host, token)
    uvicorn = require_extra("uvicorn")
    app = build_app(root, backend or SimulateBackend(), token=token, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn_config(
        app, header_timeout=header_timeout, log_level=log_level, timeout_graceful_shutdown=2
    )
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dpojax.customizer_server", description=__doc__)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="beyond loopback only with a token")
    add("--port", type=int, default=8000)
    add("--backend", choices=BACKENDS, default="simulate")
    add("--root", required=True, help="folder for uploaded files, outputs and the saved state")
    add(
        "--token-file",
        type=Path,
        help=f"file holding the bearer token every request needs (or set {TOKEN_ENV})",
    )
    add(
        "--model",
        action="append",
        default=[],
        metavar="NAME=HF_DIR",
        help="dpojax backend: map a customization config name to a local HF model folder",
    )
    add("--seconds-per-epoch", type=float, default=1.0)
    add("--deployment-ready-seconds", type=float, default=0.5)
    add("--max-page-size", type=int, default=100)
    add(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused (413)",
    )
    add(
        "--header-timeout-seconds",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="request line and headers not complete in this time: 408, connection closed",
    )
    add(
        "--body-timeout-seconds",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="request body not received whole in this time: 408, connection closed",
    )
    add("--max-running-jobs", type=int, default=1, help="dpojax backend: jobs training at once")
    add(
        "--max-queued-jobs",
        type=int,
        default=16,
        help="dpojax backend: jobs waiting; a create beyond them is refused (429)",
    )
    add("--faults", type=Path, help="JSON file: {rules: [...], job: {...}}")
    add("--enable-admin", action="store_true", help="test-only /_admin endpoints")
    add("--log-level", default="info")
    return parser


def _app_from_args(args: argparse.Namespace, token: str | None) -> Any:
    backend = make_backend(
        args.backend,
        seconds_per_epoch=args.seconds_per_epoch,
        model_map=_parse_models(args.model),
        max_running=args.max_running_jobs,
        max_queued=args.max_queued_jobs,
    )
    faults = json.loads(args.faults.read_text()) if args.faults else None
    return build_app(
        args.root,
        backend,
        faults=faults,
        admin=args.enable_admin,
        deployment_ready_seconds=args.deployment_ready_seconds,
        max_page_size=args.max_page_size,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout_seconds,
        token=token,
    )


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Command-line entry point (see the module docstring); `environ` is where
    `DPOJAX_SERVER_TOKEN` is read (default `os.environ`)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        token = resolve_server_token(args.token_file, environ)
        check_listen(args.host, token)
        config = uvicorn_config(
            _app_from_args(args, token),
            header_timeout=args.header_timeout_seconds,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )
    except (AccessError, BackendUnavailableError, StateError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if token is None:
        logging.getLogger("dpojax.customizer_server").warning(
            "no token: every local user and process that can reach %s:%d may use this server "
            "(set %s or pass --token-file to require one)",
            args.host,
            args.port,
            TOKEN_ENV,
        )
    require_extra("uvicorn").Server(config).run()
    return 0
