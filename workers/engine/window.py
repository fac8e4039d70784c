"""Samples of the last few seconds, for gauges that fall back to 0 once the engine is idle (written by the engine
thread, read by scrapes: every access takes the lock).
"""

from __future__ import annotations

import threading
import time
from collections import deque


class Window:
    def __init__(self, seconds: float = 5.0):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append((now, value))
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.seconds:
            self._samples.popleft()

    def _values(self) -> list[float]:
        with self._lock:
            self._expire(time.monotonic())
            return [v for _, v in self._samples]

    def rate(self) -> float:
        """Sum of the samples per second over the window (0 when nothing happened in it)."""
        return sum(self._values()) / self.seconds

    def mean(self) -> float:
        values = self._values()
        return sum(values) / len(values) if values else 0.0
