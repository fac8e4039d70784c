"""The worker pools and how one prefill/decode pair is picked: eligible workers only, by each role's policy."""

from __future__ import annotations

from collections import Counter

from dsv4_cluster.core import Role, WorkerState

from .errors import NoWorkers, UnknownWorker
from .policies import Chooser
from .settings import RouterSettings
from .worker import Pair, Worker


def why_none(workers: tuple[Worker, ...]) -> str:
    """Why a role has no eligible worker, in counts of workers ("1 of 1 RESTARTING and failing health checks"): the
    client's half of the 503, which names no worker and carries none of the orchestrator's free text (the log has
    both)."""
    reasons = Counter(" and ".join(r) for w in workers if (r := w.why_not_reasons()))
    return ", ".join(f"{n} of {len(workers)} {reason}" for reason, n in sorted(reasons.items()))


def comes_back(worker: Worker) -> bool:
    """Whether an ineligible worker may become eligible again without an operator: not FAILED (a crash loop) and
    not drained. STOPPED counts as coming back: an operator's `restart` reports it stopped, then nothing until
    READY (a drained one stays drained until then)."""
    return worker.state is not WorkerState.FAILED and not worker.drained


class WorkerPool:
    """Prefill and decode workers from the settings."""

    def __init__(self, settings: RouterSettings) -> None:
        breaker = {"breaker_failures": settings.breaker_failures, "breaker_cooldown_s": settings.breaker_cooldown_s}
        self.prefill = tuple(Worker(Role.PREFILL, p.name, p.url, p.bootstrap_host, p.bootstrap_port, **breaker)
                             for p in settings.prefill)
        self.decode = tuple(Worker(Role.DECODE, d.name, d.url, **breaker) for d in settings.decode)
        self._by_name = {w.name: w for w in self.workers}
        self._choosers = {Role.PREFILL: Chooser(settings.policy.prefill, prefix=settings.policy.prefix),
                          Role.DECODE: Chooser(settings.policy.decode)}

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.prefill + self.decode

    def worker(self, name: str) -> Worker:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownWorker(f"the router has no worker named {name!r}; it has {sorted(self._by_name)}") from None

    def chooser(self, role: Role) -> Chooser:
        """The role's policy and its state (the `prefix` policy's memory, for inspection)."""
        return self._choosers[role]

    @property
    def ready(self) -> bool:
        """At least one eligible prefill and one eligible decode: the router can serve."""
        return any(w.eligible for w in self.prefill) and any(w.eligible for w in self.decode)

    def answering_pair(self) -> bool:
        """An eligible prefill and decode that both answer (no connection failure since they last did)."""
        return any(w.eligible and w.answering for w in self.prefill) and \
            any(w.eligible and w.answering for w in self.decode)

    def _unavailable(self, role: Role, workers: tuple[Worker, ...]) -> NoWorkers | None:
        """Why `role` has no eligible worker (the 503 to raise), or None."""
        if not workers:
            return NoWorkers(f"the router has no {role} worker configured; add one under {role!r} in its settings",
                             soon=False)
        if any(w.eligible for w in workers):
            return None
        soon = any(comes_back(w) for w in workers)
        return NoWorkers(f"no {role} worker can take requests now ({'; '.join(w.why_not() for w in workers)})",
                         public=f"no {role} worker can take requests now ({why_none(workers)}); "
                                + ("retry later" if soon else "none will until the operator brings one back"),
                         soon=soon)

    def _choose(self, role: Role, workers: tuple[Worker, ...], avoid: frozenset[Worker],
                prompt: str | None = None) -> Worker:
        eligible = [w for w in workers if w.eligible]
        assert eligible, f"_choose({role}) with no eligible worker: pick() checks unavailable() first"
        fresh = [w for w in eligible if w not in avoid]
        return self._choosers[role].choose(fresh or eligible, prompt)

    def unavailable(self) -> NoWorkers | None:
        """The 503 for a pool with no eligible worker, or None: of a pool no worker will come back to first (no
        Retry-After: a FAILED decode behind a restarting prefill must not be retried every second), else the
        prefill's."""
        missing = [e for e in (self._unavailable(Role.PREFILL, self.prefill),
                               self._unavailable(Role.DECODE, self.decode)) if e is not None]
        return min(missing, key=lambda e: e.soon) if missing else None   # min keeps the first (prefill) of equals

    def pick(self, avoid: frozenset[Worker] = frozenset(), prompt: str | None = None) -> Pair:
        """The next eligible pair, counted in flight until `release()`; `unavailable()`'s NoWorkers if a pool has
        none. Workers in `avoid` (those of a failed attempt) are taken only when nothing else is eligible; `prompt`
        (the request's prompt text) is what the prefill's `prefix` policy matches. Nothing is chosen (no policy state
        changes) unless both pools can serve."""
        if (error := self.unavailable()) is not None:
            raise error
        return Pair(self._choose(Role.PREFILL, self.prefill, avoid, prompt),
                    self._choose(Role.DECODE, self.decode, avoid))
