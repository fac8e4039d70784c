"""Decode engine: reserve KV pages, wait for prefill's WRITE, then decode in a continuous batch.

Request lifecycle on the decode side:
1. The router's POST arrives with bootstrap_host/port/room (without them: 400, decode cannot
   prefill). The handler tokenizes and submits a `Req`; it waits in the prealloc queue until the pool
   has pages for prompt + max output (so a running request never runs out of KV).
2. With pages reserved, the engine emits `Reserved`; the handler registers this worker's NIXL agent
   with the prefill's bootstrap server (once per prefill) and tells it the room's destination pages.
3. Prefill WRITEs the KV pages and sends a notification with the room and the first output token (and, when the
   request asked for logprobs, that token's logprob and alternatives, computed where it was sampled).
   A request whose KV does not land within `transfer_timeout_s` fails with 500; one whose prefill
   failed ends as soon as the prefill says so (a "failed" notification), its pages freed at once (or
   quarantined, below, when the prefill cancelled a WRITE that NIXL could not stop: "may_land").
   Pages of a request that failed here while waiting (router abort, client gone) are quarantined
   until prefill confirms it will not write them (`on_quarantine` -> its /kv/cancel), the WRITE's
   notification arrives, or, as the last resort, the quarantine expires.
4. The request joins the running batch; each step decodes one token for every running request.
5. On EOS, a stop string, or its length budget, it finishes and its pages go back to the pool.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Callable

from ..engine.loop import Engine
from ..engine.request import Req, ReqState, Reserved, Token
from ..engine.runner import ModelRunner
from ..engine.sampling import TokenLogprob
from ..engine.tokenizer import ByteTokenizer
from ..kv.pool import PoolExhausted
from ..kv.transfer import NixlTransfer, page_runs

log = logging.getLogger(__name__)


class DecodeEngine(Engine):
    def __init__(self, runner: ModelRunner, transfer: NixlTransfer, tokenizer: ByteTokenizer,
                 transfer_timeout_s: float = 60.0, max_running: int = 64):
        super().__init__(runner, "decode-engine")
        self.transfer = transfer
        self.tokenizer = tokenizer
        self.transfer_timeout_s = transfer_timeout_s
        self.max_running = max_running
        self._prealloc: deque[Req] = deque()
        self._by_room: dict[int, Req] = {}
        self._running: list[Req] = []
        # Pages of requests that failed while prefill may still be writing into them: held until
        # their notification arrives or the quarantine expires, never handed to another request.
        self._quarantine: dict[int, tuple[list[int], float]] = {}
        # Set by the server: called (engine thread) with the room and its prefill's bootstrap URL.
        self.on_quarantine: Callable[[int, str | None], None] | None = None

    def on_submit(self, req: Req) -> None:
        self._prealloc.append(req)

    def pending(self) -> bool:
        return bool(self.reqs or self._quarantine)

    def room_held(self, room: int) -> bool:
        return room in self._quarantine     # its prefill's WRITE may still land: a new request must not wait on it

    def on_fail(self, req: Req) -> None:
        if req in self._prealloc:
            self._prealloc.remove(req)
        if req in self._running:
            self._running.remove(req)
        if req.room is not None and self._by_room.get(req.room) is req:
            del self._by_room[req.room]
            if req.state is ReqState.WAITING_PEER and req.pages:
                self._quarantine[req.room] = (req.pages, self.now() + 4 * self.transfer_timeout_s)
                req.pages = []
                if self.on_quarantine is not None:
                    self.on_quarantine(req.room, req.bootstrap)

    def release_quarantine(self, room: int) -> None:
        """Prefill will never write the room's pages: free them now (engine thread)."""
        entry = self._quarantine.pop(room, None)
        if entry is not None:
            self.runner.pool.release(entry[0])

    def step(self) -> bool:
        worked = self._reserve()
        worked |= self._receive()
        worked |= self._decode()
        s = self.stats
        s.num_queued, s.num_waiting_peer, s.num_running = (
            len(self._prealloc), len(self._by_room), len(self._running))
        return worked

    def _reserve(self) -> bool:
        worked = False
        while self._prealloc and len(self._running) + len(self._by_room) < self.max_running:
            req = self._prealloc[0]
            try:
                req.pages = self.runner.pool.alloc(req.budget)
            except PoolExhausted:
                break
            self._prealloc.popleft()
            self.stats.alloc_runs.observe(len(page_runs(req.pages, req.pages)))
            req.state = ReqState.WAITING_PEER
            req.deadline = self.now() + self.transfer_timeout_s
            self._by_room[req.room] = req
            req.emit(Reserved(list(req.pages)))
            worked = True
        for room, req in list(self._by_room.items()):
            if self.now() > req.deadline:
                self.stats.transfer_failed += 1
                self.fail(req, 500, f"KV for bootstrap_room {room} did not arrive from prefill within "
                                    f"{self.transfer_timeout_s:.0f}s")
        now = self.now()
        for room, (pages, expires) in list(self._quarantine.items()):
            if now > expires:
                del self._quarantine[room]
                self.runner.pool.release(pages)
        return worked

    def _receive(self) -> bool:
        notifs = self.transfer.notifications()
        for raw in notifs:
            try:
                msg = json.loads(raw)
                room = int(msg["room"])
                first = None if "failed" in msg else int(msg["first_token"])
                cached = int(msg.get("cached_tokens") or 0)
                first_logprob = TokenLogprob.from_wire(msg["first_logprob"]) if "first_logprob" in msg else None
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignored a malformed KV notification %r: %r", raw[:200], exc)
                continue
            if room in self._quarantine:
                if not msg.get("may_land"):   # the WRITE ended (or never began); may_land: it still may land
                    self.release_quarantine(room)
                continue
            if "failed" in msg:
                req = self._by_room.get(room)
                if req is not None:
                    if not msg.get("may_land"):   # prefill will not write: fail() frees the pages, no quarantine
                        req.state = ReqState.WAITING_PAGES
                    # else a cancelled WRITE may still land: fail() quarantines the pages (WAITING_PEER) until
                    # prefill's next message for the room says it ended
                    self.stats.transfer_failed += 1
                    self.fail(req, 500, f"prefill failed: {msg['failed']}")
                continue
            req = self._by_room.pop(room, None)
            if req is None:
                log.warning("KV arrived for unknown bootstrap_room %s; ignored", room)
                continue
            req.state = ReqState.RUNNING
            req.cached_tokens = cached
            if req.params.logprobs and first_logprob is None:
                self.fail(req, 500, f"prefill sent the first token of bootstrap_room {room} without its logprob, "
                                    "which this request asked for; is the prefill worker an older version?")
                continue
            with self.serving(req):
                self._emit_token(req, first, first_logprob)
            if req.state is ReqState.RUNNING:
                self._running.append(req)
        return bool(notifs)

    def _decode(self) -> bool:
        if not self._running:
            return False
        batch = list(self._running)
        n_prompt = [len(r.prompt_ids) for r in batch]
        logits = None
        with self.serving(*batch):
            logits = self.runner.decode([r.out[-1] for r in batch],
                                        [n + len(r.out) - 1 for n, r in zip(n_prompt, batch)],
                                        [r.pages for r in batch])
        tokens: list[int] = []
        logprobs: list = []
        if logits is not None:
            with self.serving(*batch):
                params = [r.params for r in batch]
                allowed = [r.next_ids() for r in batch]
                tokens = self.runner.sampler.sample_batch(logits, params, [len(r.out) for r in batch], allowed)
                logprobs = self.runner.sampler.logprobs_batch(logits, params, tokens, allowed)
        for req, token, logprob in zip(batch, tokens, logprobs):
            with self.serving(req):
                self._emit_token(req, token, logprob)
        self._running = [r for r in self._running if r.state is ReqState.RUNNING]
        return True

    def _emit_token(self, req: Req, token: int, logprob: TokenLogprob | None = None) -> None:
        req.out.append(token)
        req.last_token_time = time.monotonic()
        self.stats.generation_tokens += 1
        self.stats.generated.add(1, req.last_token_time)
        finish = req.finished(self.tokenizer.eos_token_id)
        req.emit(Token(token, finish, req.cached_tokens if len(req.out) == 1 else None, logprob))
        if finish is not None:
            self.finish(req)
