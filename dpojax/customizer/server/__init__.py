"""The local NeMo Customizer-compatible server (`python -m dpojax.customizer.server`).

Modules: `serve` (command line, app construction, `serve_in_thread`), `app` (the Entity Store,
Customizer and Deployment routes), `datastore` (the Datastore and HF Hub routes), `common`
(request helpers), `store` (state and files under `--root`), `backends` (what runs a job:
simulate or dpojax), `training` (the dpojax backend's training function), `faults` (fault
injection for tests).
"""

from dpojax.customizer.server.serve import (
    BACKENDS,
    ServerHandle,
    build_app,
    main,
    make_backend,
    serve_in_thread,
)

__all__ = ["BACKENDS", "ServerHandle", "build_app", "main", "make_backend", "serve_in_thread"]
