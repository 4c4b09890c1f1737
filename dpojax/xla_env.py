"""Process settings that make XLA's CPU backend fast, applied before JAX starts its backends.

The command line calls `apply_cpu_flags()` before any JAX computation; importing dpojax changes
nothing. XLA reads `XLA_FLAGS` once, when JAX first creates a backend, so in a notebook or script
call it before the first JAX computation (a session that ran JAX code first keeps its flags). A
flag the user's `XLA_FLAGS` already sets is left as the user set it; `DPOJAX_XLA_CPU_FLAGS=0`
turns the whole setting off.

The command line (`python -m dpojax.main`, `dpojax`) also restarts itself once with glibc's
malloc asking for transparent huge pages (`reexec_with_hugepage_malloc`): glibc reads its tunables
only when a process starts, so a library cannot set them for the process it is imported into.
`DPOJAX_HUGEPAGE_MALLOC=0` turns that off; a `glibc.malloc.hugetlb` value the user sets wins.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path

# XLA's concurrency-optimised scheduler orders a program so that independent ops (the q/k/v
# projections, a layer's weight and input gradients) run at the same time; on a CPU with few
# cores they then compete for the cores and the step is slower than with the ops one after the
# other (docs/benchmarks.md has the figures). Only XLA_FLAGS sets it: the CPU scheduler does not
# read per-executable compiler options. It only changes the CPU backend's schedule.
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


# glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh mapping
# and unmaps it when it is freed. XLA's CPU runtime allocates an executable's temporaries as one
# buffer per call, so each step faults in all of them as new 4 KiB pages. With this tunable
# (glibc >= 2.35) malloc marks its mappings for transparent huge pages (madvise), which cuts the
# page faults by an order of magnitude (tests/unit/test_xla_env.py; step times in docs/benchmarks.md).
# It matters where the kernel gives huge pages only to memory that asks for them (THP mode
# "madvise", the usual default); with "always" every mapping gets them anyway, with "never" none.
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None if unknown."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _glibc_version() -> tuple[int, ...] | None:
    name, version = platform.libc_ver()
    if name != "glibc":
        return None
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        return None


def hugepage_malloc_env(
    environ: Mapping[str, str] | None = None,
    machine: tuple[str | None, tuple[int, ...] | None] | None = None,
) -> dict[str, str] | None:
    """`environ` with `HUGEPAGE_TUNABLE` added to `GLIBC_TUNABLES`, for a process to be started;
    None when there is nothing to add: `DPOJAX_HUGEPAGE_MALLOC=0`, a `glibc.malloc.hugetlb`
    value already set (the user's wins), no glibc >= 2.35, or a THP mode other than "madvise".
    `machine` is (THP mode, glibc version), by default this machine's."""
    environ = os.environ if environ is None else environ
    if environ.get("DPOJAX_HUGEPAGE_MALLOC", "1").strip() == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    mode, glibc = (thp_mode(), _glibc_version()) if machine is None else machine
    if mode != "madvise" or glibc is None or glibc < (2, 35):
        return None
    return dict(environ, GLIBC_TUNABLES=":".join(filter(None, [tunables, HUGEPAGE_TUNABLE])))


def reexec_with_hugepage_malloc(
    argv: Sequence[str] | None = None,
    execve: Callable[[str, Sequence[str], Mapping[str, str]], object] = os.execve,
) -> bool:
    """Restarts this Python process with `hugepage_malloc_env()` when it adds the tunable: the same
    interpreter, options and arguments (`sys.orig_argv`), the same process id. Returns False when
    nothing is to change; with the real `os.execve` it does not return otherwise. Call it first
    thing in a command-line entry point, never from library code (it replaces the process)."""
    env = hugepage_malloc_env()
    if env is None:
        return False
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, [sys.executable, *argv[1:]], env)
    return True
