"""Whether the engine thread still comes round, as the HTTP side sees it: a no-op pinged through its inbox (one
outstanding, shared). Once it is older than `--stall-timeout-s`, `/health` answers 503 and a request with no
engine event for a second fails with a 503 naming the stall (and is aborted: its pages are freed when the engine
runs again). A long step answers after the step, so only a loop stopped past the timeout counts as stalled.
"""

from __future__ import annotations

import asyncio
import time

from ..engine.loop import Engine


class Liveness:
    def __init__(self, engine: Engine, timeout_s: float) -> None:
        self._engine, self.timeout_s = engine, timeout_s
        self._sent_at: float | None = None   # monotonic time of the outstanding ping; None: none outstanding
        self._answered = asyncio.Event()

    def _pong(self) -> None:
        self._sent_at = None
        self._answered.set()

    def _ping(self) -> None:
        if self._sent_at is None:
            loop = asyncio.get_running_loop()
            self._sent_at = time.monotonic()
            self._answered = asyncio.Event()
            self._engine.call(lambda: loop.call_soon_threadsafe(self._pong))

    def stalled(self) -> str | None:
        """Sends a ping if none is outstanding; the reason if the outstanding one is overdue, else None."""
        self._ping()
        sent = self._sent_at
        if sent is not None and time.monotonic() - sent > self.timeout_s:
            return (f"the engine made no progress for {time.monotonic() - sent:.1f} s "
                    f"(--stall-timeout-s {self.timeout_s:g})")
        return None

    async def check(self, wait_s: float = 1.0) -> str | None:
        """`stalled()`, after giving a fresh ping up to `wait_s` to come back."""
        self._ping()
        answered = self._answered
        try:
            await asyncio.wait_for(answered.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
        return self.stalled()
