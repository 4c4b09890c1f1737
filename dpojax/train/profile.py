"""`train.profile_steps = "first:last"`: a JAX profiler trace of those steps (1-based, both
included) in WORKDIR/profile, readable by TensorBoard's profile plugin and by Perfetto
(`plugins/profile/<run>/*.xplane.pb` and `*.trace.json.gz`)."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def parse_profile_steps(value: str) -> tuple[int, int] | None:
    """(first, last) of a `train.profile_steps` value, None for ''; ValueError when malformed."""
    text = str(value).strip()
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        window = (int(first), int(last) if sep else int(first))
    except ValueError:
        window = (0, 0)
    if not (1 <= window[0] <= window[1]):
        raise ValueError(
            f"{value!r}: use 'first:last' with 1 <= first <= last (e.g. 10:15), or one step"
        )
    return window


class StepProfiler:
    """Starts the trace before step `first` and stops it after step `last` (or at `close`)."""

    def __init__(self, window: tuple[int, int] | None, directory: Path):
        self.window, self.directory, self.active = window, directory, False

    def before(self, step: int) -> None:
        """Call before running step `step` (1-based)."""
        if self.window and step == self.window[0] and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d to %d into %s", *self.window, self.directory)

    def after(self, step: int, result=None) -> None:
        """Call after step `step`; `result` (its outputs) is waited for before the trace ends."""
        if self.active and step >= self.window[1]:
            if result is not None:
                jax.block_until_ready(result)
            self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
