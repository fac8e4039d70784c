"""The worker pools and how one prefill/decode pair is picked for a request.

Round-robin over each pool independently; the full router replaces this with load- and
health-aware policies, behind the same `pick()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from .errors import NoWorkers
from .settings import RouterSettings


@dataclass(frozen=True)
class Worker:
    """One upstream server. `bootstrap_host` is set for prefill workers only."""

    role: str
    name: str
    url: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None

    def describe(self) -> str:
        return f"{self.role} worker {self.name!r} at {self.url}"


@dataclass(frozen=True)
class Pair:
    prefill: Worker
    decode: Worker


class WorkerPool:
    """Prefill and decode workers from the settings, picked round-robin."""

    def __init__(self, settings: RouterSettings) -> None:
        self.prefill = tuple(
            Worker("prefill", p.name, p.url, p.bootstrap_host, p.bootstrap_port) for p in settings.prefill
        )
        self.decode = tuple(Worker("decode", d.name, d.url) for d in settings.decode)
        self._next_prefill: Iterator[Worker] = itertools.cycle(self.prefill)
        self._next_decode: Iterator[Worker] = itertools.cycle(self.decode)

    @property
    def ready(self) -> bool:
        return bool(self.prefill) and bool(self.decode)

    def pick(self) -> Pair:
        """The next pair; NoWorkers if either pool is empty."""
        if not self.prefill:
            raise NoWorkers("the router has no prefill worker configured; add one under 'prefill' in its settings")
        if not self.decode:
            raise NoWorkers("the router has no decode worker configured; add one under 'decode' in its settings")
        return Pair(next(self._next_prefill), next(self._next_decode))
