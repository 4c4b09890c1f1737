"""One run per workdir: WORKDIR/.dpojax-lock, held for the whole run.

The lock is an exclusive `flock` on that file, taken without waiting, and the file names its
holder (process id, host, start time, command). The operating system releases a `flock` when
its process ends in any way (an exception, SIGTERM, SIGKILL, a crash), so a lock left behind by
a dead run is never in the way: the next run takes it over and logs whose it was. A second run
started on a workdir in use stops at once (`WorkdirInUse`, exit 2) naming the holder, before it
writes anything (its metrics.jsonl, checkpoints and config.json stay the first run's). On a
shared disk, `flock` covers every host that mounts it where the file system supports it (NFS v4,
Lustre and GCS FUSE do locks per host at least); in a multi-process run, process 0 holds it.

Why `fcntl.flock` here and not `filelock` (installed with huggingface_hub and datasets, at any
version): the lock file holds the holder's record that a second run names in its error, and
filelock 3.x opens the file with O_TRUNC on every attempt to acquire it, so that failed attempt
would erase the record it must report (filelock 4 no longer truncates, but nothing pins it); and
where flock is missing filelock 4 falls back to a marker-file lock, which a killed run leaves
behind, while this lock's promise is that a dead run's lock is never in the way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dpojax.errors import ConfigProblem

log = logging.getLogger(__name__)

LOCK_FILE = ".dpojax-lock"


class WorkdirInUse(ConfigProblem):
    """Another running process holds the workdir's lock."""


def _holder(path: Path) -> dict:
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict) -> str:
    if not record:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", 0)))
    return f"pid {record.get('pid')} on host {record.get('host')} (since {since})"


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike, *, enabled: bool = True) -> Iterator[None]:
    """Holds WORKDIR/.dpojax-lock for the block (a no-op when not `enabled`); `WorkdirInUse` when
    another live process holds it."""
    if not enabled:
        yield
        return
    path = Path(workdir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirInUse(
                f"{workdir} is in use by another run ({_describe(_holder(path))}): wait for it "
                f"to end, stop it, or use another --workdir ({path} is released when it ends)"
            ) from None
        stale = _holder(path)
        if stale:
            log.info(
                "took over the lock of %s left by %s, no longer running", workdir, _describe(stale)
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "argv": sys.argv[:8],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # a workdir deleted mid-run has no file left
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
