"""Where a job's time goes: wall and process-CPU seconds per named phase.

    times = PhaseTimes()
    with times.phase("tokenization"):
        ...
    times.wall   # {"tokenization": 0.41}
    times.cpu    # {"tokenization": 0.78}: every thread of the process, so up to cores x wall

A phase entered again adds to its total. Phases nest: the time of a phase run inside another
counts for the inner one only. Process CPU seconds are the figure to compare between
runs on a machine that other work loads: the wall time of a phase grows with the load, its CPU
time much less. The train job and the `loop` rounds report these (`phase_seconds`,
`phase_cpu_seconds` in their summary.json).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

# The phases of a train job, and of a loop round (which includes its train job), in the order
# they run.
TRAIN_PHASES = ("setup", "tokenization", "compile", "training", "checkpoint", "export")
ROUND_PHASES = ("collection", "pairs", *TRAIN_PHASES, "evaluation")


class PhaseTimes:
    """Accumulated wall and process-CPU seconds per phase: the phases of `order` first (at 0
    until they run), then the others in the order they first ended."""

    def __init__(self, order: Sequence[str] = ()) -> None:
        self.wall: dict[str, float] = dict.fromkeys(order, 0.0)
        self.cpu: dict[str, float] = dict.fromkeys(order, 0.0)
        self._inner: list[list[float]] = []  # per open phase: wall, cpu of the phases inside

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        self._inner.append([0.0, 0.0])
        try:
            yield
        finally:
            inner_wall, inner_cpu = self._inner.pop()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            self.add(name, wall - inner_wall, cpu - inner_cpu)
            if self._inner:
                self._inner[-1][0] += wall
                self._inner[-1][1] += cpu

    def add(self, name: str, wall: float, cpu: float = 0.0) -> None:
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu

    def move(self, source: str, target: str, fraction: float) -> None:
        """Moves `fraction` (0 to 1) of phase `source`'s times to phase `target`."""
        fraction = min(max(fraction, 0.0), 1.0)
        wall, cpu = self.wall.get(source, 0.0) * fraction, self.cpu.get(source, 0.0) * fraction
        self.add(source, -wall, -cpu)
        self.add(target, wall, cpu)

    def update(self, wall: Mapping[str, float], cpu: Mapping[str, float] | None = None) -> None:
        """Adds the phases of another record (e.g. a train job's summary)."""
        for name, seconds in wall.items():
            self.add(name, seconds, (cpu or {}).get(name, 0.0))

    def rounded(self) -> tuple[dict[str, float], dict[str, float]]:
        """(wall, cpu) seconds per phase, to the millisecond, for JSON files."""
        return (
            {k: round(v, 3) for k, v in self.wall.items()},
            {k: round(v, 3) for k, v in self.cpu.items()},
        )


def describe(wall: Mapping[str, float], total: float | None = None) -> str:
    """`collection 1.3, pairs 0.2, ... s`: the phases' wall seconds in order, with what the
    phases do not cover as `other` when the `total` is given."""
    parts = [f"{name} {seconds:.1f}" for name, seconds in wall.items()]
    if total is not None:
        parts.append(f"other {max(total - sum(wall.values()), 0.0):.1f}")
    return ", ".join(parts) + " s"
