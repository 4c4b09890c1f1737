"""Starts a dpojax run as N processes on this machine, each with K CPU devices: JAX's
multi-controller runtime as on a TPU slice or a GPU cluster (one process per host), with
127.0.0.1 as the coordinator and CPU collectives between the processes.

    python scripts/launch_local.py --processes 2 --devices-per-process 2 -- \
        --config configs/tiny_test.py --workdir runs/mp --config.mesh.data=2 \
        --config.mesh.fsdp=2 --config.model.path=... --config.data.train_path=...

Everything after `--` goes to `python -m dpojax.main` in every process, followed by
`--config.distributed.coordinator_address=127.0.0.1:PORT --config.distributed.num_processes=N
--config.distributed.process_id=I`. Process 0's output is shown here (its progress bar and log);
every process's output goes to LOGS/process_I.log (default LOGS: WORKDIR/logs). When a process
fails, the others get `--grace` seconds to stop on their own (they notice at their next
collective) and are then killed; the launcher exits with the first failing process's code and
prints the end of its log. Ctrl-C or SIGTERM is passed on to every process (dpojax saves a
checkpoint and stops; restarting the same command resumes); should the launcher itself be killed
(SIGKILL), every process gets SIGTERM from the operating system (Linux).

This is how the multi-process tests run (tests/multiprocess/test_multihost.py); docs/multihost.md has the
launch recipes for TPU slices, GKE and SLURM.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# dpojax's exit code when a process stops because another one failed (dpojax.main)
NOTICED = 5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workdir(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(args):
            return args[i + 1]
    return None


def process_env(devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one process: the CPU platform with `devices` devices, and this
    checkout importable."""
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    if (ROOT / "dpojax").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _pump(stream, log_path: Path, echo: bool) -> None:
    with open(log_path, "wb") as log:
        for chunk in iter(lambda: stream.read1(65536), b""):
            log.write(chunk)
            log.flush()
            if echo:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


PR_SET_PDEATHSIG = 1
# Looked up before any fork: a child between fork and exec must not load libraries.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def _stop_with_parent() -> None:
    """In each child before it starts (Linux): SIGTERM when the launcher dies, however it dies
    (SIGKILL too), so no process is left running; dpojax saves a checkpoint and stops."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def launch(
    dpojax_args: list[str],
    *,
    processes: int,
    devices: int,
    port: int = 0,
    logs: Path | None = None,
    grace: float = 60.0,
    echo: bool = True,
) -> int:
    """Runs the processes to the end; returns 0 or the first failing process's exit code."""
    port = port or free_port()
    workdir = _workdir(dpojax_args)
    logs = Path(logs or (Path(workdir) / "logs" if workdir else "multiprocess_logs"))
    logs.mkdir(parents=True, exist_ok=True)
    procs, pumps = [], []
    for i in range(processes):
        cmd = [
            sys.executable,
            "-m",
            "dpojax.main",
            *dpojax_args,
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            f"--config.distributed.num_processes={processes}",
            f"--config.distributed.process_id={i}",
        ]
        proc = subprocess.Popen(
            cmd,
            env=process_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_stop_with_parent,
        )
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, logs / f"process_{i}.log", echo and i == 0)
        )
        pump.start()
        procs.append(proc)
        pumps.append(pump)

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first, code, deadline = _wait(procs, grace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for pump in pumps:
            pump.join()
    codes = [p.returncode for p in procs]
    print(f"launch_local: exit codes {codes}; logs in {logs}", file=sys.stderr)
    if code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    if first is not None:
        print(
            f"launch_local: process {first} failed first (exit code {code}); the end of its log:"
            f"\n{_tail(logs / f'process_{first}.log')}",
            file=sys.stderr,
        )
        if deadline:
            print(
                f"launch_local: processes still running {grace:g} s after that were killed",
                file=sys.stderr,
            )
    return code


def _wait(procs: list[subprocess.Popen], grace: float) -> tuple[int | None, int, bool]:
    """Waits for every process; after the first failure, kills those still running `grace`
    seconds later. (first failing process or None, its exit code or 0, whether any was killed)"""
    first, code, killed_after = None, 0, None
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if first is None and failed:
            # of those that ended since the last look, one that did not just notice another's end
            first = min(failed, key=lambda i: procs[i].returncode == NOTICED)
            code, killed_after = procs[first].returncode, time.monotonic() + grace
        if killed_after is not None and time.monotonic() > killed_after:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return first, code, True
        time.sleep(0.2)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if first is None and failed:
        first = min(failed, key=lambda i: procs[i].returncode == NOTICED)
        code = procs[first].returncode
    return first, code, False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description="Run dpojax as N local processes.")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--logs", type=Path, default=None, help="default: WORKDIR/logs")
    parser.add_argument("--grace", type=float, default=60.0)
    parser.add_argument("--quiet", action="store_true", help="do not show process 0's output")
    args = parser.parse_args(argv[:split])
    return launch(
        argv[split + 1 :],
        processes=args.processes,
        devices=args.devices_per_process,
        port=args.port,
        logs=args.logs,
        grace=args.grace,
        echo=not args.quiet,
    )


if __name__ == "__main__":
    sys.exit(main())
