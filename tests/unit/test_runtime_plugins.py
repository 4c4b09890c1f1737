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


def test_host_accelerators_from_device_files_and_pci_ids(tmp_path):
    from dpojax.runtime import host_accelerators

    assert host_accelerators(str(tmp_path)) == []
    pci = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    pci.mkdir(parents=True)
    (pci / "vendor").write_text("0x1af4\n")  # a virtio device: not an accelerator
    assert host_accelerators(str(tmp_path)) == []
    (pci / "vendor").write_text("0x1ae0\n")  # Google's: a TPU chip
    assert host_accelerators(str(tmp_path)) == ["tpu"]
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")
    assert host_accelerators(str(tmp_path)) == ["gpu", "tpu"]
    (pci / "vendor").unlink()
    (tmp_path / "dev/accel0").write_text("")
    assert host_accelerators(str(tmp_path)) == ["gpu", "tpu"]


_UNSET_PROBE = """
import json, sys
from dpojax import runtime
if sys.argv[1] == "darwin":  # another OS: its devices are not known from device files
    import jax  # (imported as on Linux; no backend started)
    sys.platform = "darwin"
    skipped = runtime.skip_accelerator_plugins()
    print(json.dumps(dict(skipped=skipped)))
    sys.exit(0)
skipped = runtime.skip_accelerator_plugins(accelerators=json.loads(sys.argv[1]))
import jax
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()
maps = open("/proc/self/maps").read()
print(json.dumps(dict(skipped=skipped, platforms=jax.config.jax_platforms,
                      cuda="xla_cuda_plugin" in maps, libtpu="libtpu" in maps)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_cpu_only_host_with_unset_platforms_starts_no_plugin_and_prints_no_plugin_error():
    """JAX_PLATFORMS unset (the command line's and the notebooks' usual case) on a host that shows
    no accelerator: the process is restricted to the CPU before JAX starts, so neither the CUDA
    plugin nor libtpu (both installed by the gpu-plan and test extras) is loaded, and stderr has
    none of their failed start-up checks. Where the host shows one, nothing changes."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}

    def probe(accelerators):
        out = subprocess.run(
            [sys.executable, "-c", _UNSET_PROBE, accelerators],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    got, stderr = probe("[]")
    assert got == dict(skipped=True, platforms="cpu", cuda=False, libtpu=False)
    for line in ("plugin configuration error", "worker hostname", "Traceback", "libtpu"):
        assert line not in stderr, stderr[-2000:]
    shown, _ = probe('["gpu"]')  # a host with a GPU keeps JAX's own choice (none on this host)
    assert shown["skipped"] is False and not shown["platforms"]
    assert probe("darwin")[0] == dict(skipped=False)  # e.g. jax-metal's GPU on a Mac
