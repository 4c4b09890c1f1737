"""The progress of a training run on process 0: a tqdm bar (step, loss, accuracy, tokens/s, ETA)
where a person watches, on a terminal or in a notebook; elsewhere (a batch job's log: SLURM,
Kubernetes, `nohup`, a pipe) a plain line now and then that reads well in a log file:

    train: step 120 of 1000 (12%), loss 0.6512, accuracy 0.625, 1.2k tokens/s, 2m10s, ETA 15m53s

The estimate comes from the steps after the run's first one: the first step's time includes the
step's compilation (minutes on a large model, once), so it says nothing about the pace.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# Seconds between two plain lines (the first and the last step always print one).
PLAIN_EVERY_SECONDS = 30.0


def interactive(stream: TextIO) -> bool:
    """Whether a person watches `stream`: a terminal, or a notebook's kernel."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def duration(seconds: float) -> str:
    """3s, 2m10s, 1h05m."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def rate(value: float) -> str:
    """950, 1.2k, 3.4M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


class Progress:
    """Shown by `update(metrics)` after every step; off when not `enabled`."""

    def __init__(
        self,
        enabled: bool,
        start: int,
        total: int,
        *,
        stream: TextIO | None = None,
        every_seconds: float = PLAIN_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.step, self.start, self.total = start, start, total
        self.every, self.clock = every_seconds, clock
        self.began = self.last_line = clock()
        self.paced_from: float | None = None  # when the first step ended: the pace counts after it
        self.bar = None
        self.plain = enabled and not interactive(self.stream)
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=start, desc="train", dynamic_ncols=True, file=self.stream
            )

    def update(self, metrics: dict[str, float]) -> None:
        self.step += 1
        first = self.step == self.start + 1
        if first:
            self.paced_from = self.clock()
        if self.bar is not None and first:
            self._restart_bar_clock(metrics)
        elif self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                acc=f"{metrics['rewards/accuracies']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
                refresh=False,
            )
            self.bar.update(1)
        elif self.plain:
            now = self.clock()
            last = self.step >= self.total
            if first or last or now - self.last_line >= self.every:
                self.last_line = now
                print(self.line(metrics, now), file=self.stream, flush=True)

    def _restart_bar_clock(self, metrics: dict[str, float]) -> None:
        """The bar after the first step: its clock and rate restart, so that its estimate leaves
        out the compilation."""
        self.bar.reset(total=self.total)
        self.bar.initial = self.bar.n = self.bar.last_print_n = self.step
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.4f}", acc=f"{metrics['rewards/accuracies']:.3f}"
        )

    def line(self, metrics: dict[str, float], now: float) -> str:
        """The plain line of the step just taken: the estimate from the pace of the steps after
        the first; the first step's line says that its time includes the compilation."""
        elapsed = now - self.began
        paced = self.step - self.start - 1
        if paced > 0 and self.paced_from is not None:
            eta = (now - self.paced_from) / paced * (self.total - self.step)
            timing = f"{duration(elapsed)}, ETA {duration(eta)}"
        elif self.step >= self.total:
            timing = f"{duration(elapsed)}, ETA 0s"
        else:
            timing = f"{duration(elapsed)} with compiling, ETA after the next step"
        percent = 100 * self.step // max(self.total, 1)
        return (
            f"train: step {self.step} of {self.total} ({percent}%), loss {metrics['loss']:.4f}, "
            f"accuracy {metrics['rewards/accuracies']:.3f}, "
            f"{rate(metrics['tokens_per_s'])} tokens/s, {timing}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
