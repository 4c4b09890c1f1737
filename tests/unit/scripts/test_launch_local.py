"""scripts/launch_local.py: killing the launcher (SIGKILL, which it cannot forward) still ends the
processes it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PARENT = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import launch_local
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=launch_local._stop_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (ended, not yet reaped) is not running
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_end_when_the_launcher_is_killed():
    """Before: a SIGKILLed launcher left its processes running."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ROOT / "scripts")], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
