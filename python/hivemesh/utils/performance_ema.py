"""``PerformanceEMA``: a running estimate of throughput (hivemind's
``hivemind.utils.performance_ema``)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["PerformanceEMA"]


class PerformanceEMA:
    """Samples per second, as an exponential moving average of seconds per sample with
    smoothing factor ``alpha``, corrected for its bias toward the initial 0 over the first
    updates; ``eps`` before any update and the floor of the seconds per sample. While paused
    (:meth:`pause`), time passing does not count and an update must give its ``interval``.
    """

    def __init__(self, alpha: float = 0.1, eps: float = 1e-20, paused: bool = False):
        self.alpha, self.eps, self.num_updates = alpha, eps, 0
        self.ema_seconds_per_sample, self.samples_per_second = 0.0, eps
        self.timestamp = time.perf_counter()
        self.paused = paused
        self.lock = threading.Lock()

    def update(self, task_size: float, interval: Optional[float] = None) -> float:
        """Registers ``task_size`` samples processed in ``interval`` seconds (default: since
        the last update or :meth:`reset_timer`); returns the new estimate."""
        if not task_size > 0:
            raise ValueError(f"cannot register a task of {task_size} samples")
        if self.paused:
            if interval is None:
                raise ValueError("the estimate is paused: give the task's interval")
        else:
            now = time.perf_counter()
            if interval is None:
                interval = now - self.timestamp
            self.timestamp = now
        self.ema_seconds_per_sample = (
            self.alpha * interval / task_size + (1 - self.alpha) * self.ema_seconds_per_sample
        )
        self.num_updates += 1
        correction = 1 - (1 - self.alpha) ** self.num_updates
        self.samples_per_second = 1 / max(self.ema_seconds_per_sample / correction, self.eps)
        return self.samples_per_second

    def reset_timer(self) -> None:
        """The next update counts from now."""
        self.timestamp = time.perf_counter()

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Inside this context, time passing does not count toward the estimate."""
        was_paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was_paused
            self.reset_timer()

    @contextmanager
    def update_threadsafe(self, task_size: float) -> Iterator[None]:
        """Registers ``task_size`` samples processed by the code inside the context; several
        threads may do so at once."""
        started = time.perf_counter()
        yield
        with self.lock:
            self.update(task_size, interval=time.perf_counter() - max(started, self.timestamp))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ema={self.samples_per_second:.5f}, num_updates={self.num_updates})"
