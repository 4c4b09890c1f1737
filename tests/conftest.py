"""Test-session setup: 8 fake CPU devices for sharding tests, float32 matmuls at full precision;
markers by folder."""

import os
from pathlib import Path

# Must happen before jax is imported anywhere in the test session.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
