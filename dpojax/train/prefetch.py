"""Batches built ahead of the step loop on a background thread.

`Prefetcher(produce, ahead)` calls `produce()` on its own thread and keeps up to `ahead` results
waiting: while the devices run step N, the host reads, lays out, stacks and puts on the devices
(with their final sharding) the batches of steps N+1 .. N+ahead. `ahead=0` calls `produce()` on
the caller's thread instead. An exception in `produce` is raised by the `get` that would have
returned its result; `close` stops the thread (results not taken are dropped: the loop records
the data position of each step it takes, not the producer's).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_POLL_SECONDS = 0.1


class Prefetcher(Generic[T]):
    def __init__(self, produce: Callable[[], T], ahead: int, *, name: str = "dpojax-prefetch"):
        self.produce, self.ahead = produce, ahead
        self.waited = 0.0  # seconds `get` spent waiting for a result
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(ahead, 1))
        self._thread = None
        if ahead > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _offer(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = (True, self.produce())
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                self._offer((False, e))
                return
            if not self._offer(item):
                return

    def get(self) -> T:
        start = time.perf_counter()
        try:
            if self._thread is None:
                return self.produce()
            while True:
                try:
                    ok, item = self._queue.get(timeout=_POLL_SECONDS)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the batch prefetch thread ended") from None
        finally:
            self.waited += time.perf_counter() - start
        if not ok:
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
