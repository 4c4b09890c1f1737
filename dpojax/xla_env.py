"""XLA settings that dpojax applies to the environment before JAX starts its backends.

`import dpojax` calls `apply_cpu_flags()`. XLA reads `XLA_FLAGS` once, when JAX first creates a
backend, so the flags take effect when dpojax is imported before any JAX computation (a session
that ran JAX code first keeps its flags). A flag the user's `XLA_FLAGS` already sets is left as
the user set it; `DPOJAX_XLA_CPU_FLAGS=0` turns the whole setting off.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# XLA's concurrency-optimised scheduler orders a program so that independent ops (the q/k/v
# projections, a layer's weight and input gradients) run at the same time. On a CPU with few
# cores they then compete for the cores, and the step is slower than with the ops one after the
# other: the large model's DPO step on the 2-core development machine 8.7 -> 7.8 s/step
# (docs/benchmarks.md). Only XLA_FLAGS sets it: the CPU scheduler does not read per-executable
# compiler options. It only changes the CPU backend's schedule.
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# Applied up to this many usable cores; with more, XLA's concurrent schedule is left alone (not
# measured on such machines).
MAX_CORES = 4


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def apply_cpu_flags(
    environ: MutableMapping[str, str] | None = None, cores: int | None = None
) -> list[str]:
    """Appends the flags of `CPU_FLAGS` that `XLA_FLAGS` does not set yet; returns those added.
    Nothing on machines with more than `MAX_CORES` cores or with `DPOJAX_XLA_CPU_FLAGS=0`."""
    environ = os.environ if environ is None else environ
    if environ.get("DPOJAX_XLA_CPU_FLAGS", "1").strip() == "0":
        return []
    if (usable_cores() if cores is None else cores) > MAX_CORES:
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [flag for flag in CPU_FLAGS if flag.split("=")[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
