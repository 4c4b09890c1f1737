"""The local NeMo Customizer-compatible server (`python -m dpojax.customizer_server`).

Modules: `serve` (command line, app construction, `serve_in_thread`), `app` (the app, its
middleware and error handlers), `entities`, `jobs`, `deployments` (the Entity Store, Customizer
and Deployment routes), `datastore` (the Datastore and HF Hub routes), `models` (the typed
requests), `guard` (body size, non-finite numbers, nesting), `common` (answer helpers), `store`
(state and files under `--root`), `backends` (what runs a job: simulate or dpojax, with its
queue), `training` (the dpojax backend's training function), `admin` and `faults` (fault
injection for tests).
"""

from dpojax.customizer_server.serve import (
    BACKENDS,
    ServerHandle,
    build_app,
    main,
    make_backend,
    serve_in_thread,
)

__all__ = ["BACKENDS", "ServerHandle", "build_app", "main", "make_backend", "serve_in_thread"]
