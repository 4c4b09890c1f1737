"""Several JAX processes on this machine, for the tests of what spans processes: `run_processes`
starts a helper script once per process (on a free 127.0.0.1 port) and returns each one's last
stdout line as JSON; `join` is the helper's side (CPU collectives over gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_processes(helper: Path, *args: str, count: int = 2, timeout: float = 180) -> list:
    """`python helper *args PORT PROCESS_ID` for each of `count` processes; every one must exit 0
    (its stderr's tail shown otherwise); their last stdout lines, parsed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, str(helper), *args, str(port), str(i)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def join(port: int, process_id: int, count: int = 2) -> None:
    """This process joins the others of `run_processes` (call before any other JAX work)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=count,
        process_id=process_id,
        initialization_timeout=60,
        heartbeat_timeout_seconds=10,
    )
