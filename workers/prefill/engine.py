"""Prefill engine: compute a prompt's KV, then WRITE its pages into the decode pool over NIXL.

Request lifecycle on the prefill side (each state has its queue object, `ReqQueue`: WAITING_PAGES `waiting` ->
WAITING_PEER `peer` -> TRANSFERRING `inflight`; pages of a cancelled WRITE that NIXL still holds wait in `abandoned`):
1. The router's POST arrives (same body as decode's, with bootstrap_room); the handler tokenizes
   and submits a `Req` here. It waits in `waiting` until the pool has pages for the prompt.
2. Its pages: the longest whole-page prefix already in the prefix cache (prefix_cache.py; shared, locked, not
   computed again), then new pages for the rest (evicting unlocked cached pages, least recently used first, when
   the pool is short). Each step runs one forward over chunks of the queue's first prompts, up to `chunk_tokens`
   tokens in all (batched, chunked prefill, as SGLang's --chunked-prefill-size); a prompt longer than what is left
   goes on in the next step. Once a prompt is done the engine samples its first output token and puts the
   prompt's whole pages in the cache. `_prefill_batch` picks the step's prompts: rooms decode has reserved go first,
   and take the pages of prompts computed for rooms it has not (computed again later) when the pool is short and
   theirs make room (`_allocate_preempting`); once one prompt finds the pool short, no later one takes pages, but
   those already holding pages (computed in part) go on.
3. It waits until the decode side has reserved pages for this room (`Destinations`, fed by the bootstrap server), for
   at most `peer_timeout_s` (topology: `transfer.stranded_kv_timeout_s`) from when its KV was first ready (kept by a
   prompt preempted to wait again); unreserved past the detection time it is stranded KV, freed then (stranded.py).
4. It WRITEs the prompt's pages into those pages with a notification carrying the room and the first
   token (with its logprob when asked); that notification is how decode learns the KV has landed (`_send_ready`).
   A reservation older than decode's transfer timeout, which it carries (`Destination.given_up`), gets no WRITE:
   decode has failed that request, so it is told nothing will come (its pages are free at once) and the leg fails.
5. Once the WRITE is DONE, the pages are freed and the handler answers the router with one token
   and finish_reason length (docs/protocol.md). A WRITE still in flight after `write_timeout_s` (topology:
   `transfer.write_timeout_s`; a decode that died or froze mid-write) is cancelled: the request fails, decode is
   told (it frees the room's pages, or holds them while NIXL may still write), the pages come back here once
   NIXL lets go of the transfer, and `dsv4_kv_write_timeouts_total` counts it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from ...metric_names import KV_WRITE_TIMEOUTS
from ..engine.loop import Engine
from ..engine.queues import ReqQueue
from ..engine.request import Finish, Req, ReqState, Token
from ..engine.runner import Chunk, ModelRunner
from ..kv.pool import PoolExhausted
from ..kv.prefix_cache import PrefixCache, RadixNode
from ..kv.transfer import NixlTransfer, TransferError, XferState, page_runs
from .destinations import Destinations, failed_message, notif_message, prompt_digest
from .stranded import StrandedKV

log = logging.getLogger(__name__)
NOTIFY_PROGRESS_S = 2.0   # how long the loop drives NIXL after a notification (seen here: the first one took 50 ms)


@dataclass(frozen=True)
class Write:
    """A WRITE in flight: NIXL's handle, when it started, how many bytes."""
    handle: object
    started: float
    nbytes: int


@dataclass(frozen=True)
class AbandonedWrite:
    """A WRITE cancelled past its deadline that NIXL could not stop: its pages wait here until NIXL lets go."""
    room: int | None
    handle: object
    rid: str
    pages: list[int]


class PrefillEngine(Engine):
    def __init__(self, runner: ModelRunner, transfer: NixlTransfer, peer_timeout_s: float = 30.0,
                 chunk_tokens: int = 1024, write_timeout_s: float = 30.0, prefix_cache: bool = True):
        super().__init__(runner, "prefill-engine")
        self.chunk_tokens, self.transfer = chunk_tokens, transfer
        self.destinations = Destinations(ttl_s=peer_timeout_s * 4)
        self.peer_timeout_s = peer_timeout_s
        self.waiting: ReqQueue[None] = ReqQueue(ReqState.WAITING_PAGES)   # prompt not computed yet (or in part)
        self.peer: ReqQueue[float] = ReqQueue(ReqState.WAITING_PEER)       # KV ready since (monotonic), no reservation
        self.inflight: ReqQueue[Write] = ReqQueue(ReqState.TRANSFERRING)
        self.write_timeout_s = write_timeout_s
        self.abandoned: list[AbandonedWrite] = []
        self.cache = PrefixCache(runner.pool) if prefix_cache else None
        self._locks: dict[str, list[RadixNode]] = {}      # rid -> the cache nodes its pages include (locked)
        self.stranded = StrandedKV(peer_timeout_s, runner.pool.layout.page_size)
        self._progress_until = 0.0              # NIXL progress is driven until then: a notification is on its way

    def on_submit(self, req: Req) -> None:
        self.waiting.put(req, None)

    def room_held(self, room: int) -> bool:
        return self.destinations.agent_of(room) is not None   # a WRITE (of an ended request) NIXL still runs

    def on_fail(self, req: Req) -> None:
        self.waiting.pop(req)   # a request in flight stays in `inflight` until NIXL ends its WRITE
        self.peer.pop(req)
        if req.room is not None and req.state is not ReqState.TRANSFERRING:
            self.destinations.discard(req.room)

    def pending(self) -> bool:
        return bool(self.reqs or self.abandoned) or self.now() < self._progress_until

    def step(self) -> bool:
        if self.now() < self._progress_until:
            self.transfer.progress()
        worked = self._poll_inflight()
        worked |= self._poll_abandoned()
        worked |= self._send_ready()
        self._free_stranded()
        worked |= self._prefill_batch()
        s = self.stats
        s.num_queued, s.num_waiting_peer, s.num_transferring = len(self.waiting), len(self.peer), len(self.inflight)
        return worked

    def _prefill_batch(self) -> bool:
        budget, chunks, reqs, short = self.chunk_tokens, [], [], False
        for req in sorted(self.waiting, key=lambda r: self.destinations.pages(r.room) is None):  # reserved first
            if budget <= 0:
                break
            if not req.pages and (short or not self._allocate_preempting(req)):
                short = True   # no later prompt takes pages first; those computed in part go on (and free theirs)
                continue
            n = min(len(req.prompt_ids) - req.prefilled, budget)
            chunks.append(Chunk(req.prompt_ids[req.prefilled: req.prefilled + n], req.prefilled, req.pages))
            reqs.append(req)
            budget -= n
        if not chunks:
            return False
        logits = None
        with self.serving(*reqs):   # an exception fails these requests (on_fail unqueues them), never the engine
            logits = self.runner.extend(chunks)
        for req, chunk, row in zip(reqs, chunks, logits if logits is not None else ()):
            req.prefilled = chunk.start + len(chunk.token_ids)
            if req.prefilled < len(req.prompt_ids):
                continue
            self.waiting.pop(req)
            with self.serving(req):
                allowed = req.next_ids()
                req.out.append(self.runner.sampler.sample(row, req.params, 0, allowed))
                if req.params.logprobs:
                    req.first_logprob = self.runner.sampler.logprobs(row, req.params, req.out[0], allowed)
            if req.state is ReqState.ABORTED:   # sampling failed just above
                continue
            self.stats.prompt_tokens += len(req.prompt_ids)
            if self.cache is not None:
                self._locks[req.rid] = self.cache.insert(req.prompt_ids, req.pages, self._locks.get(req.rid, []))
            self.peer.put(req, self.now() if req.first_ready is None else req.first_ready)   # stranded from then
        return True

    def _allocate_preempting(self, req: Req) -> bool:
        """Pages for `req`, or False. When the pool is short and decode already reserved pages for `req`, prompts
        computed for rooms decode has not reserved give theirs up, latest first, and are computed again later: a
        decode pool full of reservations like this one's reserves nothing else, so holding that KV deadlocked both
        pools (each full, each waiting on the other) until the timeouts failed the requests. None gives its pages
        up unless all of theirs would make room (else their KV was thrown away and computed again for nothing)."""
        while True:
            try:
                self._allocate(req)
                return True
            except PoolExhausted:
                victims = [r for r in self.peer if self.destinations.pages(r.room) is None]
                if self.destinations.pages(req.room) is None or not victims or not self._room_with(req, victims):
                    return False
                v = victims[-1]   # the latest
                ready = self.peer.pop(v)
                self._free_pages(v.rid, v.pages)
                self.stats.prompt_tokens -= len(v.prompt_ids)   # counted again when it is computed again
                v.pages, v.prefilled, v.out, v.first_logprob, v.first_ready = [], 0, [], None, ready
                self.waiting.put(v, None)

    def _room_with(self, req: Req, victims: list[Req]) -> bool:
        """Whether `req`'s new pages fit once `victims` gave theirs up: a cached page counts when only victims hold
        it (a system prompt they share too), the pages of `req`'s own cached prefix once."""
        pool, spare, cached, c = self.runner.pool, self.runner.pool.free_pages, [], self.cache
        if c is not None:
            cached, nodes = c.match(req.prompt_ids)
            c.unlock(nodes)
            spare += c.evictable_pages - sum(c.holders(p) == 0 for p in cached)   # its own prefix
        return pool.pages_for(len(req.prompt_ids)) - len(cached) <= spare + len(self._freed_by(victims) - set(cached))

    def _allocate(self, req: Req) -> None:
        """The request's pages: its cached prefix (locked), then new ones; PoolExhausted (nothing held) if short."""
        pool = self.runner.pool
        follow = self.destinations.pages(req.room) if req.room is not None else None   # decode reserved first
        if self.cache is None:
            pages = own = pool.alloc(len(req.prompt_ids), follow)
        else:
            got = self.cache.allocate(req.prompt_ids, follow)
            if got is None:
                raise PoolExhausted(f"{pool.pages_for(len(req.prompt_ids))} pages needed, {pool.free_pages} free "
                                    "and nothing left to evict")
            pages, own, self._locks[req.rid] = got
        req.pages, req.prefilled = pages, (len(pages) - len(own)) * pool.layout.page_size
        self.stats.alloc_runs.observe(len(page_runs(own, own)))
        if req.first_ready is not None:   # the cache may hold its own pages now: what it found the first time, at most
            req.cached_tokens = min(req.cached_tokens, req.prefilled)
            return
        req.cached_tokens = req.prefilled
        if self.cache is not None:
            self.cache.record(len(req.prompt_ids), req.cached_tokens)

    def release(self, req: Req) -> None:
        """Unlock the request's cached pages; its own pages that the cache does not hold go back to the pool."""
        if req.pages and req.state is not ReqState.TRANSFERRING:
            self._free_pages(req.rid, req.pages)
            req.pages = []

    def _freed_by(self, reqs: list[Req]) -> set[int]:
        """The pages releasing `reqs` would make available: their own ones, and cached ones only they hold."""
        held, c = Counter(p for r in reqs for p in r.pages), self.cache
        return {p for p, n in held.items() if c is None or not c.owns(p) or c.holders(p) == n}

    def _free_pages(self, rid: str, pages: list[int]) -> None:
        if self.cache is None:
            self.runner.pool.release(pages)
            return
        self.cache.unlock(self._locks.pop(rid, []))
        self.runner.pool.release([p for p in pages if not self.cache.owns(p)])

    def flush_cache(self) -> int:
        """Evict every unlocked cached page (engine thread); returns how many."""
        return self.cache.flush() if self.cache is not None else 0

    def role_metrics(self) -> list[tuple[str, str, str, float]]:
        return [*self.stranded.metrics(),
                ("counter", KV_WRITE_TIMEOUTS, "KV writes cancelled past transfer.write_timeout_s",
                 self.stats.write_timeouts)]

    def _free_stranded(self) -> None:
        """Recount stranded KV; fail the requests past their deadline, which frees their pages."""
        now, dest = self.now(), self.destinations
        late = self.stranded.late(((r, r.first_ready) for r in self.waiting if dest.pages(r.room) is None), now)
        for req in [*self.stranded.scan(self.peer.items(), now), *late]:
            self.stats.bootstrap_failed += 1
            self.stranded.freed(req, len(self._freed_by([req])))
            self.fail(req, 500, f"decode never reserved KV for bootstrap_room {req.room} within "
                                f"{self.peer_timeout_s:g}s; its stranded KV is freed. Is the decode server "
                                "reachable and alive? (topology: transfer.stranded_kv_timeout_s)")

    def _send_ready(self) -> bool:
        worked = False
        for req in self.peer:
            dest = self.destinations.take(req.room)
            if dest is None:
                if self.destinations.cancelled(req.room):
                    self.fail(req, 500, f"decode gave up bootstrap_room {req.room} before its KV was sent")
                continue
            self.peer.pop(req)
            worked, reason = True, None
            if dest.prompt is not None and dest.prompt != prompt_digest(req.prompt_ids):
                reason = f"bootstrap_room {req.room} was reserved by decode for another prompt (two requests share it)"
            elif dest.given_up(self.now()):
                reason = (f"decode stopped waiting for the KV of bootstrap_room {req.room} {dest.waits_s:g}s after "
                          "reserving it, before it was ready here; nothing was written")
            if reason is not None:
                self._tell_decode_failed(req.room, reason)
                self.fail(req, 500, reason)
                continue
            with self.serving(req):
                try:
                    handle = self.transfer.write_pages(dest.agent_name, req.pages, dest.pages,
                                                       notif_message(req.room, req.out[0], req.cached_tokens,
                                                                     req.first_logprob),
                                                       dest.incarnation)
                except TransferError as exc:
                    self.stats.transfer_failed += 1
                    self._tell_decode_failed(req.room, f"KV transfer failed: {exc}")
                    self.fail(req, 500, f"KV transfer failed: {exc}")
            if req.state is not ReqState.WAITING_PEER:   # failed just above
                continue
            self.inflight.put(req, Write(handle, self.now(), self.runner.pool.page_bytes * len(req.pages)))
        return worked

    def _tell_decode_failed(self, room: int, reason: str, may_land: bool = False) -> None:
        """Best effort: decode frees the room's pages at once instead of at its deadline (with `may_land` it
        holds them, and the room stays taken, until `_poll_abandoned` says the WRITE ended)."""
        agent = self.destinations.agent_of(room) if may_land else self.destinations.done(room)
        if agent is not None:
            self.tell_decode(agent, failed_message(room, reason, may_land))

    def tell_decode(self, agent: str, message: bytes) -> None:
        """Send a decode agent a notification (engine thread). No progress thread runs and a notification is not
        a transfer the loop polls: to a decode this agent never wrote to (no connection yet) it would not leave
        unless the loop drives NIXL, so it does for `NOTIFY_PROGRESS_S`."""
        try:
            self.transfer.notify(agent, message)
        except TransferError as exc:
            log.warning("could not tell %s %s: %s", agent, message[:200], exc)
            return
        self._progress_until = self.now() + NOTIFY_PROGRESS_S

    def _poll_inflight(self) -> bool:
        worked = False
        for req, write in self.inflight.items():
            state = self.transfer.poll(write.handle)
            if state is XferState.PROC:
                if self.now() - write.started > self.write_timeout_s:
                    self._expire(req, write)
                    worked = True
                continue
            worked = True
            self.inflight.pop(req)
            was_aborted = req.state is ReqState.ABORTED
            req.state = ReqState.FINISHED
            if state is XferState.DONE:
                self.destinations.done(req.room)
                secs = max(self.now() - write.started, 1e-9)
                self.stats.transfer_ms.add(secs * 1e3)
                self.stats.transfer_gb_s.add(write.nbytes / secs / 1e9)
                if not was_aborted:
                    req.emit(Token(req.out[0], Finish("length"), req.cached_tokens, req.first_logprob))
                self.finish(req)
            else:
                self._tell_decode_failed(req.room, f"KV transfer of bootstrap_room {req.room} failed in NIXL")
                self.stats.transfer_failed += 1
                req.state = ReqState.WAITING_PEER      # pages are ours again; fail() frees them
                if was_aborted:
                    self.finish(req)
                else:
                    self.fail(req, 500, f"KV transfer of bootstrap_room {req.room} failed in NIXL")
        return worked

    def _expire(self, req: Req, write: Write) -> None:
        """A WRITE past `write_timeout_s`: cancel it, tell decode, fail the request; pages NIXL may still read
        stay out of the pool until it lets go of the transfer (`_poll_abandoned`)."""
        self.inflight.pop(req)
        self.stats.transfer_failed += 1
        self.stats.write_timeouts += 1
        cancelled = self.transfer.abandon(write.handle)
        reason = (f"KV transfer of bootstrap_room {req.room} did not finish within {self.write_timeout_s:g}s "
                  "(topology: transfer.write_timeout_s); is the decode server alive and reachable?")
        self._tell_decode_failed(req.room, reason, may_land=not cancelled)
        if not cancelled:
            self.abandoned.append(AbandonedWrite(req.room, write.handle, req.rid, req.pages))
            req.pages = []
        was_aborted = req.state is ReqState.ABORTED
        req.state = ReqState.WAITING_PEER      # the pages (if any left) are ours again: fail()/finish() free them
        if was_aborted:
            self.finish(req)
        else:
            self.fail(req, 500, reason)

    def _poll_abandoned(self) -> bool:
        """Pages of cancelled WRITEs that NIXL kept go back to the pool once it ends them; decode is told."""
        worked = False
        for item in list(self.abandoned):
            if self.transfer.poll(item.handle) is XferState.PROC:
                continue
            self.abandoned.remove(item)
            self._free_pages(item.rid, item.pages)
            self._tell_decode_failed(item.room, f"the cancelled KV transfer of bootstrap_room {item.room} ended")
            worked = True
        return worked
