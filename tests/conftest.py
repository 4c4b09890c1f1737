"""Test-session setup: 8 fake CPU devices for sharding tests, float32 matmuls at full precision;
markers by folder."""

import atexit
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Must happen before jax is imported anywhere in the test session.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One JAX compilation cache for the whole session, in this process and every run it starts (the
# CLI runs inherit the environment): the suite compiles the same tiny models' steps again and
# again, in fresh processes that would otherwise each pay every compile. JAX keys each entry by
# the program, the backend and XLA_FLAGS, so a hit is the executable that compile would give; only
# compiles of at least JAX's default second are kept. A session's directory is new and removed at
# exit, so no run of the suite sees another's entries; DPOJAX_TEST_JAX_CACHE=0 turns it off.
if (
    os.environ.get("DPOJAX_TEST_JAX_CACHE", "1") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
):
    _cache = tempfile.mkdtemp(prefix="dpojax-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# A folder this session shares with its xdist workers (they inherit the environment): the lock
# files that keep `exclusive` tests alone on the machine. Removed at exit by the process that made it.
if "DPOJAX_TEST_SESSION_DIR" not in os.environ:
    _session = tempfile.mkdtemp(prefix="dpojax-test-session-")
    os.environ["DPOJAX_TEST_SESSION_DIR"] = _session
    atexit.register(shutil.rmtree, _session, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (CI runs 2 workers, .ci/run), a test marked `exclusive` (every
    multi-process test: its processes' heartbeats and its stop-within-seconds checks assume the
    cores are theirs) runs while no other test does; the others share the machine. A readers-writer
    lock over two files: each test passes a turnstile, then holds the room shared; an exclusive
    test holds the turnstile until it has the room alone, so the other workers wait at the
    turnstile instead of starving it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    folder = Path(os.environ["DPOJAX_TEST_SESSION_DIR"])
    with open(folder / "turnstile", "a") as turnstile, open(folder / "room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


# Kinds of test, one folder each: tests/<kind>/... gets the marker <kind> (registered in
# pyproject.toml). End-to-end and multi-process tests start whole runs in fresh processes: they
# are also `slow`; slow tests elsewhere are marked one by one.
KINDS = ("unit", "e2e", "multiprocess", "hygiene")
SLOW_KINDS = ("e2e", "multiprocess")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.resolve()
        if TESTS not in path.parents:
            continue
        kind = path.relative_to(TESTS).parts[0]
        if kind in KINDS:
            item.add_marker(kind)
        if kind in SLOW_KINDS:
            item.add_marker("slow")
        if kind == "multiprocess":
            item.add_marker("exclusive")
    # `newest` picks slow tests for CI's newest-JAX leg as well (.ci/run): on a fast test it
    # would mean nothing, since that leg runs every fast test anyway.
    wrong = [i.nodeid for i in items if i.get_closest_marker("newest") and not _is_slow(i)]
    if wrong:
        raise pytest.UsageError(f"marked newest but not slow (newest picks slow tests): {wrong}")


def _is_slow(item) -> bool:
    return item.get_closest_marker("slow") is not None
