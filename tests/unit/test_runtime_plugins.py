"""A CPU-only run does not load the accelerator plugins JAX would discover."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import jax
from dpojax import runtime
if sys.argv[1] == "cpu,tpu":
    jax.config.update("jax_platforms", "cpu,tpu")
skipped = runtime.skip_accelerator_plugins() if sys.argv[2] == "skip" else None
if sys.argv[1] != "cpu":  # a backend this host lacks: nothing is started
    print(json.dumps(dict(skipped=skipped)))
    sys.exit(0)
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()
maps = open("/proc/self/maps").read()
again = runtime.skip_accelerator_plugins()  # the backends are started: nothing to do
print(json.dumps(dict(skipped=skipped, again=again, cuda="xla_cuda_plugin" in maps,
                      platform=jax.default_backend())))
"""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package (the jax_plugins namespace) is absent
        return False


_CUDA_PLUGIN = _installed("jax_plugins.xla_cuda12")


def _probe(platforms: str, skip: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, platforms, skip],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_cpu_only_processes_skip_the_plugins():
    got = _probe("cpu", "skip")
    assert got == dict(skipped=True, again=False, cuda=False, platform="cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.skipif(not _CUDA_PLUGIN, reason="jax's CUDA plugin is not installed")
def test_without_the_skip_the_cuda_plugin_is_loaded_and_other_platforms_keep_it():
    """The skip is what keeps it out: JAX loads it under JAX_PLATFORMS=cpu otherwise; a platform
    list naming another backend is left alone."""
    assert _probe("cpu", "none")["cuda"]
    assert _probe("cpu,tpu", "skip") == dict(skipped=False)
