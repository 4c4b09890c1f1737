"""Where a training run's time went (summary.json's `timing`, report.md's section of that name):
compilation (JAX's own compile events: tracing, lowering to MLIR, XLA), the steps (the wall time
between two consecutive steps' results, median and 90th percentile), the time the step loop
waited for its next batch, checkpoint saves (the part the loop waits for) and evaluations;
tokens/s, and model FLOP utilisation per device where the chip's peak is known
(`dpojax.hardware.chips`; dpojax's FLOP model, `dpojax.train.flops`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np

# JAX's duration events that together are one compilation.
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


class RunTimer:
    """Accumulates the run's phases; a context manager around the step loop (it listens to JAX's
    compile events while open, on every thread)."""

    def __init__(self, devices: int, peak_flops: float | None):
        self.devices, self.peak_flops = devices, peak_flops
        self.compile = 0.0
        self.phases = {"input_wait": 0.0, "checkpoint": 0.0, "evaluation": 0.0}
        self.step_seconds: list[float] = []
        self.tokens = 0.0
        self.flops = 0.0
        self.flops_seconds = 0.0
        self._lock = threading.Lock()
        self._last: float | None = None
        self._start = 0.0
        self._compiled_before = 0.0
        self.wall: float | None = None  # the step loop's, once it has ended

    def _listen(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self.compile += duration

    def __enter__(self) -> RunTimer:
        self._start = self._last = time.perf_counter()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            jax.monitoring.unregister_event_duration_listener(self._listen)
        self.wall = time.perf_counter() - self._start

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - start

    def restart_interval(self) -> None:
        """The next step's interval starts now (after an evaluation or a save, which are not step
        time)."""
        self._last = time.perf_counter()
        self._compiled_before = self.compile

    def step_done(self, tokens: float, flops: float | None) -> float:
        """Records a step whose results were just read; returns its seconds. A step whose
        interval included a compilation counts in tokens but not in the step times."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        compiled, self._compiled_before = self.compile > self._compiled_before, self.compile
        self.tokens += tokens
        if not compiled:
            self.step_seconds.append(seconds)
            if flops is not None:
                self.flops += flops
                self.flops_seconds += seconds
        return seconds

    def summary(self) -> dict[str, float | int | None]:
        steps = self.step_seconds
        wall = self.wall if self.wall is not None else time.perf_counter() - self._start
        out = {
            "wall_seconds": wall,
            "compile_seconds": self.compile,
            "step_seconds_median": percentile(steps, 50),
            "step_seconds_p90": percentile(steps, 90),
            "timed_steps": len(steps),
            **{f"{name}_seconds": value for name, value in self.phases.items()},
            "tokens_per_second": self.tokens / wall if wall > 0 else None,
            "model_flops_per_second_per_device": None,
            "mfu_per_device": None,
        }
        if self.flops_seconds > 0:
            per_device = self.flops / self.flops_seconds / self.devices
            out["model_flops_per_second_per_device"] = per_device
            if self.peak_flops:
                out["mfu_per_device"] = per_device / self.peak_flops
        return out


def report_lines(timing: dict) -> list[str]:
    """report.md's "Where the time went" section."""

    def fmt(value, unit: str = " s") -> str:
        if value is None:
            return "-"
        return f"{value:.3g}{unit}" if isinstance(value, float) else f"{value}{unit}"

    rows = [
        ("wall time of the step loop", fmt(timing.get("wall_seconds"))),
        ("compilation (all steps, on any thread)", fmt(timing.get("compile_seconds"))),
        ("step time, median", fmt(timing.get("step_seconds_median"))),
        ("step time, 90th percentile", fmt(timing.get("step_seconds_p90"))),
        ("waiting for input", fmt(timing.get("input_wait_seconds"))),
        ("checkpoint saves (blocking part)", fmt(timing.get("checkpoint_seconds"))),
        ("evaluation", fmt(timing.get("evaluation_seconds"))),
        ("tokens/s", fmt(timing.get("tokens_per_second"), "")),
        ("model FLOP/s per device", fmt(timing.get("model_flops_per_second_per_device"), "")),
        ("MFU per device", fmt(timing.get("mfu_per_device"), "")),
    ]
    out = ["## Where the time went", "", "| phase | value |", "|---|---|"]
    return out + [f"| {name} | {value} |" for name, value in rows] + [""]
