"""JAX process setup that the command line applies explicitly, after flags are parsed and before
the config is validated: multi-host initialisation and the persistent compilation cache.

(Environment variables that must be set before JAX starts its backends are in
`dpojax.xla_env`.) Library code never calls these on import.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_collections

DISTRIBUTED_INIT = ("auto", "always", "never")
# Environment variables that show a multi-process launch (TPU pods, SLURM, MPI, JAX's own).
MULTI_PROCESS_ENV = (
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "JAX_COORDINATOR_ADDRESS",
)


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """`jax.distributed.initialize()` when configured (`distributed.*`) or detected from the
    environment; `distributed.initialize=never` turns it off."""
    import jax

    d = config.distributed
    if d.initialize == "never":
        return
    kwargs = {}
    if d.coordinator_address:
        kwargs = dict(
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes or None,
            process_id=None if d.process_id < 0 else d.process_id,
        )
    multi_process_env = any(k in os.environ for k in MULTI_PROCESS_ENV)
    if d.initialize == "always" or kwargs or multi_process_env:
        jax.distributed.initialize(**kwargs)


def enable_compilation_cache(
    path: str, workdir: str | os.PathLike, *, min_compile_seconds: float = 1.0
) -> Path | None:
    """Turns on JAX's persistent compilation cache in `path` (relative: under `workdir`), so a
    later run or loop round with the same shapes loads its steps instead of compiling them again.
    Only compilations of at least `min_compile_seconds` are cached (docs/benchmarks.md has what
    each threshold measured on the tic-tac-toe recipe). Returns the directory, or None when
    `path` is ""."""
    if not path:
        return None
    import jax

    directory = Path(workdir) / path if not os.path.isabs(path) else Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
