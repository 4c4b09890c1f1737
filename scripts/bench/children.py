"""One script, two roles: the parent that starts fresh processes of the same script, and the
child (a measurement worker, or the writer of the inputs) that prints one JSON line last.
Used by scripts/bench_quant_load.py and scripts/bench_quant_step.py; imports nothing heavy, so a
parent stays small (a child's ru_maxrss starts from its parent's resident memory at the fork)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def child_json(script: str, argv: list[str], what: str, env: Mapping[str, str]) -> dict:
    """The last JSON line of `script` run in a fresh process with `argv` and `env`; exits
    naming `what` with the child's stderr when it fails."""
    cmd = [sys.executable, script, *argv]
    done = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child_role(args, worker: Callable, write: Callable[..., dict]) -> bool:
    """Plays the child's role when `args` asks for one (`--worker DIR MODE`: `worker(DIR, MODE,
    args)`; `--write-only DIR`: `write(args, DIR)`, its record printed with the seconds it took)
    and says whether it did."""
    if args.worker:
        worker(*args.worker, args)
        return True
    if args.write_only:
        start = time.perf_counter()
        written = write(args, Path(args.write_only))
        print(json.dumps({**written, "write_s": round(time.perf_counter() - start, 1)}))
        return True
    return False
