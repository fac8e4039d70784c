"""One worker as the router sees it: where it is, and its standing (state, drained, health, breaker, load).

A worker is paired only while it is *eligible*: its state (told by the orchestrator through the admin
API, `docs/router_admin.md`) is READY, an operator has not drained it, the router's own health checks
pass, and its circuit breaker is closed. `in_flight` counts the requests it is part of, pick to release.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dsv4_cluster.core import Role, WorkerState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    """One upstream server and its standing. `bootstrap_host` is set for prefill workers only."""

    role: Role
    name: str
    url: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    state: WorkerState = WorkerState.READY
    reason: str | None = None
    drained: bool = False
    healthy: bool = True
    health_failures: int = 0  # consecutive failed health checks (health.py)
    in_flight: int = 0
    token_usage: float = 0.0
    queued: int = 0  # its backlog: SGLang's queue gauges for its role (`health.QUEUE_GAUGES`, read by health checks)
    kv_tokens: int | None = None  # its KV capacity (`/server_info` max_total_num_tokens; read for the prefix policy)
    failures: int = 0  # consecutive connection-level failures (the breaker's count)
    last_failure: float = 0.0  # monotonic time of its last connection-level failure (a held request waits past it)
    last_ok: float = 0.0  # ... of its last sign of life: an answer, a passed health check, a READY report
    open_until: float = 0.0  # monotonic time the breaker stays open until; 0: closed
    pairs: set[Pair] = field(default_factory=set, repr=False)  # the pairs it is part of, pick to release

    def lost(self, why: str) -> None:
        """The worker stopped answering (health checks): end every request it is part of now, so that none
        waits on a hung process until `request_timeout_s` (each request's attempt decides how, attempt.py)."""
        for pair in list(self.pairs):
            pair.lost(self, why)

    def ready_again(self) -> None:
        """Its supervisor reports it READY after a restart: its readiness probes (its `/health` among them) just
        passed, so it counts as a passed health check, and the breaker's count of the old process's refused
        connections is dropped. Without this a worker `status` shows READY could wait a health-check interval
        (or a breaker cooldown) before it is paired; the next failed checks take it out again as usual."""
        self.healthy, self.health_failures = True, 0
        self.failures, self.open_until = 0, 0.0
        self.kv_tokens = None                       # a restart may change it: read it again
        self.alive_at(time.monotonic())

    def describe(self) -> str:
        """How client-facing messages name the worker: role and name, never its internal URL."""
        return f"{self.role.value} worker {self.name!r}"

    @property
    def breaker_open(self) -> bool:
        return self.open_until > 0.0 and time.monotonic() < self.open_until

    @property
    def eligible(self) -> bool:
        return self.state is WorkerState.READY and not self.drained and self.healthy and not self.breaker_open

    @property
    def answering(self) -> bool:
        """No connection-level failure since its last sign of life: a held request tries it (`Flight.hold`)."""
        return self.last_failure <= self.last_ok

    @property
    def load(self) -> float:
        return self.in_flight + self.token_usage

    def alive_at(self, t: float) -> None:
        """Evidence that the worker answered at monotonic time `t` (or later): the time the evidence was sought,
        not when this loop got round to it, so that an answer the process gave before it died, read after a
        request recorded its death, never makes it look answering again (a held request would be retried at once
        on a dead worker until `max_retries` ran out, instead of waiting for the restart)."""
        self.last_ok = max(self.last_ok, t)

    def record(self, ok: bool, gone: bool = True, at: float | None = None) -> None:
        """The breaker hears how a connection to this worker went: `breaker_failures` failures in a row open it
        for `breaker_cooldown_s`; after that one request may try again (one more failure opens it again).
        `gone`: the failure says the process may be gone (not the keep-alive race on a reused connection).
        `at`: when the answer was asked for (`alive_at`), now if not given."""
        if ok:
            self.alive_at(time.monotonic() if at is None else at)
            if self.open_until:
                log.warning("%s answers again; circuit breaker closed", self.describe())
            self.failures, self.open_until = 0, 0.0
            return
        self.failures += 1
        if gone:
            self.last_failure = time.monotonic()
        if self.failures >= self.breaker_failures:
            if not self.breaker_open:
                log.warning("%s: %d connection failures in a row; circuit breaker open for %g s",
                            self.describe(), self.failures, self.breaker_cooldown_s)
            self.open_until = time.monotonic() + self.breaker_cooldown_s

    def why_not_reasons(self) -> list[str]:
        """Why an ineligible worker is skipped, in fixed words (the client's 503 counts them, `pool.why_none`)."""
        why = [self.state.value] if self.state is not WorkerState.READY else []
        if self.drained:
            why.append("drained")
        if not self.healthy:
            why.append("failing health checks")
        if self.breaker_open:
            why.append("circuit breaker open")
        return why

    def why_not(self) -> str:
        """Why an ineligible worker is skipped, with its name and the orchestrator's reason: for the log."""
        why = self.why_not_reasons()
        if self.reason and self.state is not WorkerState.READY:
            why[0] += f" ({self.reason})"
        return f"{self.name}: {', '.join(why)}"

    def entry(self) -> dict[str, Any]:
        """The admin API's view of the worker."""
        return {"name": self.name, "role": self.role.value, "url": self.url, "state": self.state.value,
                "reason": self.reason, "drained": self.drained, "in_flight": self.in_flight,
                "healthy": self.healthy, "breaker_open": self.breaker_open, "token_usage": self.token_usage,
                "eligible": self.eligible}


@dataclass(eq=False)
class Pair:
    """The two workers of one request; `release()` ends their share of it (idempotent)."""

    prefill: Worker
    decode: Worker
    _released: bool = field(default=False, repr=False)
    _prefill_counted: bool = field(default=True, repr=False)
    on_lost: Callable[[Worker, str], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for worker in (self.prefill, self.decode):
            worker.in_flight += 1
            worker.pairs.add(self)

    def lost(self, worker: Worker, why: str) -> None:
        if self.on_lost is not None and not self._released:
            self.on_lost(worker, why)

    def prefill_finished(self) -> None:
        """P answered: its share of the load ends now, while the stream goes on at D (a prefill's load is what it
        still has to do, which the load-aware policies, `prefix` among them, compare), and it is part of the request
        no more: the KV is at D, so losing P (`Worker.lost`) ends nothing."""
        if not self._released and self._prefill_counted:
            self._prefill_counted = False
            self.prefill.in_flight -= 1
            self.prefill.pairs.discard(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.on_lost = None   # the attempt's method: Attempt -> request -> pair -> it was a cycle per request
            if self._prefill_counted:
                self.prefill.in_flight -= 1
            self.decode.in_flight -= 1
            for worker in (self.prefill, self.decode):
                worker.pairs.discard(self)
