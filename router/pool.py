"""The worker pools: each worker's standing in the router, and how one prefill/decode pair is picked.

A worker is paired only while it is *eligible*: its state (told by the orchestrator through the admin
API, `docs/router_admin.md`) is READY, an operator has not drained it, and the router's own health
checks pass. `in_flight` counts the requests a worker is part of, from pick to release.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from dsv4_cluster.core import WorkerState

from .errors import NoWorkers, UnknownWorker
from .settings import RouterSettings


@dataclass(eq=False)
class Worker:
    """One upstream server and its standing. `bootstrap_host` is set for prefill workers only."""

    role: str
    name: str
    url: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    state: WorkerState = WorkerState.READY
    reason: str | None = None
    drained: bool = False
    healthy: bool = True
    in_flight: int = 0

    def describe(self) -> str:
        """How client-facing messages name the worker: role and name, never its internal URL."""
        return f"{self.role} worker {self.name!r}"

    @property
    def eligible(self) -> bool:
        return self.state is WorkerState.READY and not self.drained and self.healthy

    def why_not(self) -> str:
        """Why an ineligible worker is skipped, for the 503 a client sees when nothing is eligible."""
        why = []
        if self.state is not WorkerState.READY:
            why.append(self.state.value + (f" ({self.reason})" if self.reason else ""))
        if self.drained:
            why.append("drained")
        if not self.healthy:
            why.append("failing health checks")
        return f"{self.name}: {', '.join(why)}"

    def entry(self) -> dict[str, Any]:
        """The admin API's view of the worker."""
        return {"name": self.name, "role": self.role, "url": self.url, "state": self.state.value,
                "reason": self.reason, "drained": self.drained, "in_flight": self.in_flight,
                "healthy": self.healthy, "eligible": self.eligible}


@dataclass(eq=False)
class Pair:
    """The two workers of one request; `release()` ends their share of it (idempotent)."""

    prefill: Worker
    decode: Worker
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.prefill.in_flight -= 1
            self.decode.in_flight -= 1


class WorkerPool:
    """Prefill and decode workers from the settings; eligible ones picked round-robin."""

    def __init__(self, settings: RouterSettings) -> None:
        self.prefill = tuple(
            Worker("prefill", p.name, p.url, p.bootstrap_host, p.bootstrap_port) for p in settings.prefill
        )
        self.decode = tuple(Worker("decode", d.name, d.url) for d in settings.decode)
        self._by_name = {w.name: w for w in self.workers}
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.prefill + self.decode

    def worker(self, name: str) -> Worker:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownWorker(f"the router has no worker named {name!r}; it has {sorted(self._by_name)}") from None

    @property
    def ready(self) -> bool:
        """At least one eligible prefill and one eligible decode: the router can serve."""
        return any(w.eligible for w in self.prefill) and any(w.eligible for w in self.decode)

    def _choose(self, role: str, workers: tuple[Worker, ...]) -> Worker:
        if not workers:
            raise NoWorkers(f"the router has no {role} worker configured; add one under {role!r} in its settings")
        eligible = [w for w in workers if w.eligible]
        if not eligible:
            raise NoWorkers(f"no {role} worker can take requests now "
                            f"({'; '.join(w.why_not() for w in workers)}); retry later")
        return eligible[next(self._turn[role]) % len(eligible)]

    def pick(self) -> Pair:
        """The next eligible pair, counted in flight until `release()`; NoWorkers if a pool has none."""
        pair = Pair(self._choose("prefill", self.prefill), self._choose("decode", self.decode))
        pair.prefill.in_flight += 1
        pair.decode.in_flight += 1
        return pair
