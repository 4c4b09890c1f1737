"""The progress of a training run on process 0: a tqdm bar (step, loss, accuracy, tokens/s, ETA)
where a person watches, on a terminal or in a notebook; elsewhere (a batch job's log: SLURM,
Kubernetes, `nohup`, a pipe) a plain line now and then that reads well in a log file:

    train: step 120 of 1000 (12%), loss 0.6512, accuracy 0.625, 1.2k tokens/s, 2m10s, ETA 15m53s
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
        self.bar = None
        self.plain = enabled and not interactive(self.stream)
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=start, desc="train", dynamic_ncols=True, file=self.stream
            )

    def update(self, metrics: dict[str, float]) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                acc=f"{metrics['rewards/accuracies']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
                refresh=False,
            )
            self.bar.update(1)
        elif self.plain:
            now = self.clock()
            first, last = self.step == self.start + 1, self.step >= self.total
            if first or last or now - self.last_line >= self.every:
                self.last_line = now
                print(self.line(metrics, now), file=self.stream, flush=True)

    def line(self, metrics: dict[str, float], now: float) -> str:
        """The plain line of the step just taken."""
        elapsed = now - self.began
        done = self.step - self.start
        eta = elapsed / done * (self.total - self.step) if done else 0.0
        percent = 100 * self.step // max(self.total, 1)
        return (
            f"train: step {self.step} of {self.total} ({percent}%), loss {metrics['loss']:.4f}, "
            f"accuracy {metrics['rewards/accuracies']:.3f}, "
            f"{rate(metrics['tokens_per_s'])} tokens/s, {duration(elapsed)}, "
            f"ETA {duration(eta)}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
