"""The memory a run may plan to use, per device: the device's own limit on a TPU or GPU; on a CPU
the host memory available to this process (the smaller of the system's available memory and what
its cgroup still allows), less a margin for what lives outside the compiled step (the input
pipeline, the tokenizer, checkpoint copies, the compiler itself)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

# Share of the available host memory a CPU run plans to fill with its compiled step.
CPU_MARGIN = 0.8
_CGROUP = Path("/sys/fs/cgroup")
_MEMINFO = Path("/proc/meminfo")


@dataclasses.dataclass(frozen=True)
class Usable:
    """Bytes a step may use per device, and where the figure comes from (one line)."""

    bytes: float
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def mem_available(meminfo: Path = _MEMINFO) -> int | None:
    """The kernel's estimate of the memory available for new work (MemAvailable), in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom(root: Path = _CGROUP) -> int | None:
    """What this process's cgroup still allows (memory.max less memory.current, cgroup v2; the
    v1 limit less usage), in bytes; None without a limit."""
    limit = _read_int(root / "memory.max")
    used = _read_int(root / "memory.current")
    if limit is None:  # v1, or v2 with "max" (no limit)
        limit = _read_int(root / "memory" / "memory.limit_in_bytes")
        used = _read_int(root / "memory" / "memory.usage_in_bytes")
        if limit is not None and limit >= 2**60:  # v1's "no limit"
            limit = None
    if limit is None:
        return None
    return max(limit - (used or 0), 0)


def host_usable(margin: float = CPU_MARGIN, *, meminfo=_MEMINFO, cgroup=_CGROUP) -> Usable:
    """The CPU figure: `margin` of the smaller of MemAvailable and the cgroup's headroom."""
    figures = {"MemAvailable": mem_available(meminfo), "cgroup limit": cgroup_headroom(cgroup)}
    known = {name: value for name, value in figures.items() if value is not None}
    if not known:
        raise RuntimeError(
            f"cannot read the available memory ({meminfo}, {cgroup}); set train.usable_memory_gib"
        )
    name = min(known, key=known.get)
    return Usable(
        margin * known[name],
        f"{margin:.0%} of the host's available memory ({name}: {known[name] / 2**30:.1f} GiB)",
    )


def device_usable(device) -> Usable | None:
    """A TPU's or GPU's allocator limit (`bytes_limit` of its memory stats); None where the
    device reports none (a CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return None
    return Usable(float(limit), f"{device.device_kind}'s allocator limit")


def usable(device, override_gib: float = 0.0) -> Usable:
    """What the auto-fit check plans for on `device`: `override_gib` when > 0
    (train.usable_memory_gib), else the device's limit, else the host's (`host_usable`)."""
    if override_gib > 0:
        return Usable(override_gib * 2**30, "train.usable_memory_gib")
    return device_usable(device) or host_usable()
