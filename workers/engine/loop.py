"""The engine thread both roles share: an inbox, a scheduling loop, aborts, and live statistics.

HTTP handlers never touch the model or the pool: they `submit` a `Req` and read its events. Nothing one request
does may end the engine (`serving(...)` fails those requests with a 500); if the loop itself dies, every request
held is failed and `on_death` makes the server exit non-zero, so its supervisor restarts it.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.utils import floatToGoString

from .request import Aborted, Failed, Outbox, Req, ReqState
from .runner import ModelRunner
from .window import Window

log = logging.getLogger(__name__)


RUN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@dataclass
class Buckets:
    """Observations counted under upper bounds (Prometheus histogram buckets, read at scrape time)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bound, then past the last one (+Inf)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, n = [], 0
        for bound, count in zip([*(floatToGoString(b) for b in self.bounds), "+Inf"], self.counts):
            n += count
            out.append((bound, n))
        return out


@dataclass
class EngineStats:
    """Counters and gauges the metrics endpoint and /server_info read (written by the engine thread)."""

    num_running: int = 0
    num_queued: int = 0
    num_waiting_peer: int = 0
    num_transferring: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    aborted: int = 0
    bootstrap_failed: int = 0
    transfer_failed: int = 0
    write_timeouts: int = 0          # prefill: KV writes cancelled past their deadline (a subset of transfer_failed)
    internal_errors: int = 0
    # the last few seconds only, so the gauges read 0 once the engine is idle
    generated: Window = field(default_factory=Window)
    transfer_gb_s: Window = field(default_factory=Window)
    transfer_ms: Window = field(default_factory=Window)
    alloc_runs: Buckets = field(default_factory=lambda: Buckets(RUN_BUCKETS))   # runs per request's new pages

    @property
    def last_gen_throughput(self) -> float:
        return self.generated.rate()


class EngineKilled(RuntimeError):
    """Raised on the engine thread by the `--test-hooks` kill endpoint: the loop dies as from a bug."""


class Engine:
    """Base scheduling loop. Subclasses implement `step()` -> bool (True if it did work).

    Nothing spins while idle: with no live request the loop blocks on its inbox (waking once per
    `idle_wait_s` for deadlines); while requests wait on NIXL (a WRITE in flight, KV not arrived) it
    polls every `poll_s`, and that polling is what drives NIXL's progress (its agents run without a
    progress thread; transfer.py).
    """

    idle_wait_s = 1.0
    poll_s = 0.001

    def __init__(self, runner: ModelRunner, name: str):
        self.runner = runner
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.reqs: dict[str, Req] = {}
        self.fatal: str | None = None
        self._outbox = Outbox()
        self.on_death: Callable[[str], None] = lambda reason: None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def submit(self, req: Req) -> None:
        self._inbox.put(("submit", req))

    def abort(self, rid: str, reason: str = "aborted by request", finished: bool = False) -> None:
        """End a request: with a 499 error, or (`finished`, /abort_request's) as finished with what it has."""
        self._inbox.put(("abort", (rid, reason, finished)))

    def call(self, fn) -> None:
        """Run `fn()` on the engine thread (for state that only the engine may touch)."""
        self._inbox.put(("call", fn))

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.runner is not None:         # engines without a model (unit tests' stand-ins) have none
                self.runner.use_device()        # the current CUDA device is per thread (cuda:N, N > 0)
            while not self._stop.is_set():
                drained = self._drain()
                worked = self.step()
                self._outbox.flush()
                if not (drained or worked):
                    self._wait_for_work()
        except BaseException as exc:   # the engine is dead: fail every request loudly, never hang them
            log.exception("engine thread died")
            self.fatal = f"engine thread died: {exc!r}"
            for req in list(self.reqs.values()):
                req.emit(Failed(500, f"{self.fatal}; the worker restarts, retry the request"))
            self._outbox.flush()
            self.reqs.clear()
            self.on_death(self.fatal)

    @contextlib.contextmanager
    def serving(self, *reqs: Req) -> Iterator[None]:
        """Work for `reqs` only: an exception fails these requests with a 500, never the engine."""
        try:
            yield
        except Exception as exc:
            log.exception("the engine failed request(s) %s; it goes on serving", [r.rid for r in reqs])
            self.stats.internal_errors += 1
            for req in reqs:
                if req.state not in (ReqState.FINISHED, ReqState.ABORTED):
                    self.fail(req, 500, f"the engine failed this request: {exc!r}")

    def role_metrics(self) -> list[tuple[str, str, str, float]]:
        """Role hook: ("gauge" | "counter", name, help, value) a role exports beyond SGLang's names."""
        return []

    def pending(self) -> bool:
        """Role hook: whether something needs polling (a request in flight, a deadline)."""
        return bool(self.reqs)

    def _wait_for_work(self) -> None:
        try:
            item = self._inbox.get(timeout=self.poll_s if self.pending() else self.idle_wait_s)
        except queue.Empty:
            return
        self._handle(item)

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            self._handle(item)

    def _handle(self, item) -> None:
        kind, payload = item
        if kind == "submit":
            payload.emit = self._outbox.wrap(payload.emit)
            refused = self.room_in_use(payload.room)
            if refused is not None:     # never held: nothing of the request it collides with is touched
                payload.state = ReqState.ABORTED
                payload.emit(Failed(400, refused))
                return
            self.reqs[payload.rid] = payload
            self.stats.requests += 1
            self.on_submit(payload)
        elif kind == "abort":
            rid, reason, finished = payload
            req = self.reqs.get(rid)
            if req is not None:
                self.stats.aborted += 1
                self.end(req, Aborted(reason) if finished else Failed(499, reason), ReqState.ABORTED)
        else:
            payload()

    def room_in_use(self, room: int | None) -> str | None:
        """Why a request that just arrived is refused (400) before it is held, or None: its bootstrap_room is
        one a live request (or `room_held`) has. KV is matched to a request by its room alone: two at once got
        each other's KV, and one of them waited forever."""
        if room is None or not (any(r.room == room for r in self.reqs.values()) or self.room_held(room)):
            return None
        return (f"bootstrap_room {room} is in use by another request on this worker; give each request its own "
                "room")

    def room_held(self, room: int) -> bool:
        """Role hook: whether KV of `room` is still held or in flight beyond the live requests."""
        return False

    def on_submit(self, req: Req) -> None:
        """Called on the engine thread when a request arrives."""

    def release(self, req: Req) -> None:
        """Free the request's pages unless a transfer may still write or read them."""
        if req.pages and req.state is not ReqState.TRANSFERRING:
            self.runner.pool.release(req.pages)
            req.pages = []

    def finish(self, req: Req, state: ReqState = ReqState.FINISHED) -> None:
        req.state = state
        self.release(req)
        self.reqs.pop(req.rid, None)

    def fail(self, req: Req, status: int, message: str, state: ReqState = ReqState.ABORTED) -> None:
        self.end(req, Failed(status, message), state)

    def end(self, req: Req, event: Failed | Aborted, state: ReqState = ReqState.ABORTED) -> None:
        """End a request before it finished: `event` (an error, or /abort_request's finish) is its last."""
        keep_pages = req.state is ReqState.TRANSFERRING
        self.on_fail(req)
        req.emit(event)
        if keep_pages:
            req.state = state
            self.reqs.pop(req.rid, None)
        else:
            self.finish(req, state)

    def on_fail(self, req: Req) -> None:
        """Role hook: drop the request from role-specific queues."""

    def step(self) -> bool:
        raise NotImplementedError

    @staticmethod
    def now() -> float:
        return time.monotonic()
