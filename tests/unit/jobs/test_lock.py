"""One run per workdir: a second run on a locked workdir stops before writing anything, naming the
holder; the lock is released however its holder ends (SIGKILL included), and a lock file left by a
dead process is taken over."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from dpojax.config import frozen
from dpojax.errors import EXIT_CONFIG
from dpojax.jobs.workdir.lock import LOCK_FILE, WorkdirInUse, workdir_lock

HOLD = """
import sys, time
from dpojax.jobs.workdir.lock import workdir_lock
with workdir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(workdir):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with workdir_lock(tmp_path):
        with pytest.raises(WorkdirInUse) as info, workdir_lock(tmp_path):
            pass
        record = json.loads((tmp_path / LOCK_FILE).read_text())
    message = str(info.value)
    assert f"pid {os.getpid()}" in message and str(tmp_path) in message
    assert record["pid"] == os.getpid() and info.value.exit_code == EXIT_CONFIG
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: the holder's record cleared
    with workdir_lock(tmp_path):  # and free again
        pass


def test_released_on_an_exception(tmp_path):
    with pytest.raises(RuntimeError), workdir_lock(tmp_path):
        raise RuntimeError("boom")
    with workdir_lock(tmp_path):
        pass


def test_a_killed_holder_leaves_a_lock_the_next_run_takes_over(tmp_path, caplog):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(WorkdirInUse, match=f"pid {proc.pid} on host"), workdir_lock(tmp_path):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind
    with caplog.at_level(logging.INFO, logger="dpojax.jobs.workdir.lock"), workdir_lock(tmp_path):
        pass
    assert f"left by pid {proc.pid}" in caplog.text


def test_train_on_a_workdir_in_use_writes_nothing(tmp_path):
    """Before: two runs on one workdir both started; both failed inside the checkpoint library
    and metrics.jsonl kept duplicated rows (a later second run truncated the first's)."""
    from dpojax.config import default_config
    from dpojax.jobs.train import train

    work = tmp_path / "run"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 0.5}\n')
    proc = _holder(work)
    before = sorted(p.name for p in work.iterdir())
    try:
        start = time.monotonic()
        with pytest.raises(WorkdirInUse):
            train(frozen(default_config()), work)
        assert time.monotonic() - start < 5  # refused before loading anything
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(p.name for p in work.iterdir()) == before
    assert (work / "metrics.jsonl").read_text().count("\n") == 1
