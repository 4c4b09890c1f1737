"""The XLA CPU flags dpojax sets before JAX starts: added once, the user's choice kept, and
effective (XLA schedules the step differently with them). The command line's restart with glibc's
huge-page malloc: once, same process, the user's choice kept, and effective (XLA's per-call
temporaries fault in far fewer pages)."""

import json
import os
import subprocess
import sys

import pytest

from dpojax import xla_env
from dpojax.xla_env import (
    CPU_FLAGS,
    HUGEPAGE_TUNABLE,
    MAX_CORES,
    apply_cpu_flags,
    hugepage_malloc_env,
    reexec_with_hugepage_malloc,
    thp_mode,
    usable_cores,
)

FLAG = CPU_FLAGS[0]
NAME = FLAG.split("=")[0]


def test_adds_the_flags_once_after_the_users():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert apply_cpu_flags(env, cores=2) == [FLAG]
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}"
    assert apply_cpu_flags(env, cores=2) == []  # idempotent
    assert env["XLA_FLAGS"].count(NAME) == 1
    empty = {}
    apply_cpu_flags(empty, cores=1)
    assert empty == {"XLA_FLAGS": FLAG}


def test_keeps_the_users_setting_and_can_be_turned_off():
    env = {"XLA_FLAGS": f"{NAME}=true"}
    assert apply_cpu_flags(env, cores=2) == []
    assert env["XLA_FLAGS"] == f"{NAME}=true"
    off = {"DPOJAX_XLA_CPU_FLAGS": "0"}
    assert apply_cpu_flags(off, cores=2) == [] and "XLA_FLAGS" not in off
    many = {}
    assert apply_cpu_flags(many, cores=MAX_CORES + 1) == [] and many == {}


_PROBE = """
import json, os, sys
from dpojax.xla_env import apply_cpu_flags
if os.environ.get("PROBE_APPLY") == "1":
    apply_cpu_flags()
import jax, jax.numpy as jnp

def f(x, a, b, c):
    return jnp.sum(jnp.tanh(x @ a) * (x @ b) + x @ c)

args = [jnp.ones((64, 64))] * 4
text = jax.jit(jax.grad(f, argnums=(1, 2, 3))).lower(*args).compile().as_text()
print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "hlo": text}))
"""


def _probe(**env_overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DPOJAX_XLA_CPU_FLAGS")}
    env.update(env_overrides, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() > MAX_CORES, reason="the flags apply up to MAX_CORES cores")
def test_applied_flags_reach_xla_and_importing_sets_none():
    """`apply_cpu_flags()` before JAX starts sets XLA_FLAGS in time: the compiled program's
    schedule equals the one XLA makes when the user passes the flag, and differs from XLA's
    default one, which is what a plain import of dpojax leaves."""
    ours = _probe(PROBE_APPLY="1")
    assert FLAG in ours["xla_flags"].split()
    explicit = _probe(XLA_FLAGS=FLAG)
    default = _probe()
    assert NAME not in default["xla_flags"]
    assert ours["hlo"] == explicit["hlo"]
    assert ours["hlo"] != default["hlo"]


def test_the_command_line_applies_the_flags_before_running(monkeypatch):
    from dpojax import main as cli_main

    seen = {}
    monkeypatch.setattr(xla_env, "reexec_with_hugepage_malloc", lambda: False)
    monkeypatch.setattr(xla_env, "usable_cores", lambda: 2)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(
        cli_main.app,
        "run",
        lambda main, argv=None, flags_parser=None: seen.update(flags=os.environ["XLA_FLAGS"]),
    )
    cli_main.cli()
    assert seen["flags"].split() == ["--xla_force_host_platform_device_count=8", FLAG]


def test_hugepage_env_adds_the_tunable_and_keeps_the_users_choice():
    ok = dict(machine=("madvise", (2, 36)))
    assert hugepage_malloc_env({"A": "1"}, **ok) == {"A": "1", "GLIBC_TUNABLES": HUGEPAGE_TUNABLE}
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert hugepage_malloc_env(env, **ok) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}"
    }
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}  # a new mapping, input kept
    # nothing to do: already set (any value, the user's wins), turned off, or no use here
    assert hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, **ok) is None
    assert hugepage_malloc_env({"GLIBC_TUNABLES": HUGEPAGE_TUNABLE}, **ok) is None
    assert hugepage_malloc_env({"DPOJAX_HUGEPAGE_MALLOC": "0"}, **ok) is None
    for mode in ("always", "never", None):
        assert hugepage_malloc_env({}, machine=(mode, (2, 36))) is None
    for glibc in ((2, 34), None):
        assert hugepage_malloc_env({}, machine=("madvise", glibc)) is None


def test_thp_mode_reads_the_bracketed_value(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(str(path)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None


def test_reexec_runs_the_same_command_with_the_tunable(monkeypatch):
    monkeypatch.setattr(xla_env, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(xla_env, "_glibc_version", lambda: (2, 36))
    monkeypatch.delenv("DPOJAX_HUGEPAGE_MALLOC", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    calls = []
    argv = ["python3", "-X", "dev", "-m", "dpojax.main", "--config", "configs/x.py"]
    assert reexec_with_hugepage_malloc(argv, execve=lambda *a: calls.append(a))
    [(path, args, env)] = calls
    assert path == sys.executable
    assert args == [sys.executable, "-X", "dev", "-m", "dpojax.main", "--config", "configs/x.py"]
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=4:{HUGEPAGE_TUNABLE}"
    # the restarted process finds it set and goes on
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])
    assert not reexec_with_hugepage_malloc(argv, execve=lambda *a: calls.append(a))
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    monkeypatch.setenv("DPOJAX_HUGEPAGE_MALLOC", "0")
    assert not reexec_with_hugepage_malloc(argv, execve=lambda *a: calls.append(a))
    assert len(calls) == 1


_HUGEPAGES_USABLE = hugepage_malloc_env({}) is not None
_NOT_USABLE = "needs glibc >= 2.35 and the kernel's THP mode 'madvise'"

_CLI_PROBE = """
import os, sys
print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), flush=True)
sys.argv = ["dpojax", "--helpshort"]
from dpojax.main import cli
cli()
"""


@pytest.mark.skipif(not _HUGEPAGES_USABLE, reason=_NOT_USABLE)
def test_cli_restarts_once_in_the_same_process_with_the_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",)}
    env.pop("DPOJAX_HUGEPAGE_MALLOC", None)
    out = subprocess.run(
        [sys.executable, "-c", _CLI_PROBE], env=env, capture_output=True, text=True
    )
    runs = [line.split(" ", 2) for line in out.stdout.splitlines() if line.startswith("run ")]
    assert [r[2] for r in runs] == ["", HUGEPAGE_TUNABLE]  # restarted once, then went on
    assert runs[0][1] == runs[1][1]  # the same process id: exec, not a child
    assert "dpojax: DPO training in JAX" in out.stdout, out.stderr  # --help: the command itself ran
    off = subprocess.run(
        [sys.executable, "-c", _CLI_PROBE],
        env=dict(env, DPOJAX_HUGEPAGE_MALLOC="0"),
        capture_output=True,
        text=True,
    )
    off_runs = [line.split(" ", 2) for line in off.stdout.splitlines() if line.startswith("run ")]
    assert [r[2] for r in off_runs] == [""]  # turned off: no restart


_FAULT_PROBE = """
import json, resource
import jax, jax.numpy as jnp

@jax.jit
def f(x, w):  # a 64 MiB temporary (sin(x) feeds the dot) in every call
    return jnp.sum(jnp.sin(x) @ w)

x, w = jnp.ones((4096, 4096)), jnp.ones((4096, 8))
f(x, w).block_until_ready()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _HUGEPAGES_USABLE, reason=_NOT_USABLE)
def test_hugepage_malloc_cuts_the_page_faults_of_xlas_temporaries():
    """Each call allocates its temporaries anew: in 4 KiB pages that is one fault per page
    (64 MiB: ~16k), with the tunable a small fraction of that."""
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    base["JAX_PLATFORMS"] = "cpu"

    def faults(env):
        out = subprocess.run(
            [sys.executable, "-c", _FAULT_PROBE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return min(json.loads(out.stdout.strip().splitlines()[-1]))

    plain = faults(base)
    huge = faults(hugepage_malloc_env(base))
    assert plain > 8_000, plain
    assert huge * 8 < plain, (huge, plain)
