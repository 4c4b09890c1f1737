"""The XLA CPU flags dpojax sets before JAX starts: added once, the user's choice kept, and
effective (XLA schedules the step differently with them)."""

import json
import os
import subprocess
import sys

import pytest

from dpojax.xla_env import CPU_FLAGS, MAX_CORES, apply_cpu_flags, usable_cores

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
import dpojax
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


@pytest.mark.skipif(usable_cores() > MAX_CORES, reason="the flags apply up to MAX_CORES cores")
def test_import_sets_the_flag_before_jax_compiles_and_xla_uses_it():
    """Importing dpojax first sets XLA_FLAGS in time: the compiled program's schedule equals the
    one XLA makes when the user passes the flag, and differs from XLA's default one."""
    ours = _probe()
    assert FLAG in ours["xla_flags"].split()
    explicit = _probe(XLA_FLAGS=FLAG)
    default = _probe(DPOJAX_XLA_CPU_FLAGS="0")
    assert NAME not in default["xla_flags"]
    assert ours["hlo"] == explicit["hlo"]
    assert ours["hlo"] != default["hlo"]
