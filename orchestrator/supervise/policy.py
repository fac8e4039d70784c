"""How a supervisor judges its worker: liveness probes, restarts with backoff, the crash-loop limit."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class HealthPolicy:
    """Poll a READY worker's `/health` every interval_s; the first failure makes it DEGRADED (the
    router stops pairing it), failures_to_restart consecutive failures get it killed and restarted."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    failures_to_restart: int = 3


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a crashed worker after backoff_s, doubling per recent crash up to backoff_max_s;
    give up (FAILED) once more than max_restarts crashes fall within window_s."""

    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def delay(self, recent_crashes: int) -> float | None:
        if recent_crashes > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (recent_crashes - 1), self.backoff_max_s)


class CrashWindow:
    """The crashes of one worker within its policy's window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._at: deque[float] = deque()

    def record(self) -> float | None:
        """Count a crash now; the backoff before the restart, or None when it is a crash loop."""
        now = time.monotonic()
        self._at.append(now)
        while self._at and now - self._at[0] > self._policy.window_s:
            self._at.popleft()
        return self._policy.delay(len(self._at))

    def __len__(self) -> int:
        return len(self._at)

    def times(self) -> list[float]:
        """The crashes in the window, time.monotonic() (system-wide on Linux: a restarted supervisor's process on
        the same node reads them on its own clock)."""
        return list(self._at)

    def restore(self, times: list[float]) -> None:
        """Go on with the window a previous supervisor process recorded (`times`)."""
        self._at.extend(times)

    def clear(self) -> None:
        """Forget the crashes so far: an operator's restart starts a new window (and a FAILED worker gets its
        backoff restarts again, not FAILED at its next crash for the crashes before it)."""
        self._at.clear()

    def giving_up(self, reason: str) -> str:
        n = len(self._at)
        return (f"gave up after {n} crash{'es' if n != 1 else ''} within {self._policy.window_s:.0f}s "
                f"(crash loop); last: {reason}")
