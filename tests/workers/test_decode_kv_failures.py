"""The decode side of a KV write that dies: a prefill's `failed` notification frees the room's pages at once; with
`may_land` (a cancelled WRITE that NIXL could not stop) they are quarantined, never handed to another request, until
the prefill's next message for the room says the WRITE ended; nothing leaks and the engine serves on.

Real parts throughout: the decode engine's own thread, model runner and NIXL agent; the prefill is a real
`PrefillEngine` with its own agent, and the `failed` messages are the bytes its `_tell_decode_failed` sends
(`failed_message`), delivered by NIXL. The prefill's sending of `may_land` itself needs a NIXL that refuses to
cancel, which is covered in test_write_deadline.py.
"""

from __future__ import annotations

import os
import threading

import pytest

from dsv4_cluster.workers.decode.engine import DecodeEngine
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.prefill.destinations import failed_message
from dsv4_cluster.workers.prefill.engine import PrefillEngine
from dsv4_cluster.workers.engine.request import Failed, Req, Reserved, Token
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer
from dsv4_cluster.workers.kv.transfer import NixlTransfer

from tests.helpers import wait_for

PAGE, POOL = 16, 2048           # the decode pool: 128 pages
PROMPT = [40 + i % 50 for i in range(300)]


def _runner() -> ModelRunner:
    return ModelRunner(RunnerConfig(model=ModelConfig(), page_size=PAGE, max_total_tokens=POOL, context_length=2048))


class _Client:
    """One request's view: its events as the engine emits them."""

    def __init__(self, room: int, budget: int, new_tokens: int = 8):
        self.events: list = []
        self.ended = threading.Event()
        self.req = Req(rid=f"r{room}", prompt_ids=PROMPT, params=SamplingParams(max_new_tokens=new_tokens,
                                                                                temperature=0),
                       budget=budget, emit=self._emit, room=room, bootstrap="http://127.0.0.1:9")

    def _emit(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Failed) or (isinstance(event, Token) and event.finish is not None):
            self.ended.set()

    def reserved(self) -> list[int] | None:
        return next((e.pages for e in self.events if isinstance(e, Reserved)), None)


@pytest.fixture
def sides():
    tag = os.getpid()
    decode_runner, prefill_runner = _runner(), _runner()
    decode_nixl = NixlTransfer(f"dkf-decode-{tag}", decode_runner.pool)
    prefill_nixl = NixlTransfer(f"dkf-prefill-{tag}", prefill_runner.pool)
    prefill_nixl.add_peer(decode_nixl.local_info())
    decode = DecodeEngine(decode_runner, decode_nixl, ByteTokenizer(), transfer_timeout_s=60)
    quarantined: list[int] = []
    decode.on_quarantine = lambda room, bootstrap: quarantined.append(room)   # the server asks /kv/cancel here
    prefill = PrefillEngine(prefill_runner, prefill_nixl)
    decode.start()
    prefill.start()
    yield decode, prefill, quarantined
    decode.stop()
    prefill.stop()


def _reserve(decode: DecodeEngine, client: _Client) -> list[int]:
    decode.submit(client.req)
    return wait_for(client.reserved, 30, f"decode's reservation for room {client.req.room}")


def _tell(prefill: PrefillEngine, decode: DecodeEngine, message: bytes) -> None:
    """Send decode a message from the prefill's engine thread, as its `_tell_decode_failed` does."""
    prefill.call(lambda: prefill.tell_decode(decode.transfer.name, message))


def test_failed_frees_the_rooms_pages_at_once_and_may_land_holds_them_until_the_write_ended(sides):
    decode, prefill, quarantined = sides
    pool = decode.runner.pool

    # 1. the prefill's WRITE is refused before it starts (decode restarted since it reserved the pages): the prefill
    # fails its request and tells decode, which frees the room's pages at once; no WRITE ever connected the agents
    plain, pre = _Client(room=1, budget=600), _Client(room=1, budget=600)
    assert len(_reserve(decode, plain)) == 38 and pool.used_tokens == 38 * PAGE
    prefill.destinations.put(1, decode.transfer.name, plain.reserved(), incarnation=0)   # current: 1
    prefill.submit(pre.req)
    assert pre.ended.wait(60) and "restarted after it reserved" in pre.events[-1].message
    assert plain.ended.wait(10), "decode never heard that the prefill failed (it would wait transfer_timeout_s)"
    assert [type(e).__name__ for e in plain.events] == ["Reserved", "Failed"]
    assert plain.events[-1].status == 500 and "prefill failed: KV transfer failed" in plain.events[-1].message
    wait_for(lambda: pool.used_tokens == 0, 10, "the failed room's pages back in the pool")
    assert quarantined == [] and not decode.pending()              # freed, not quarantined

    # 2. a cancelled WRITE that NIXL could not stop (may_land): the pages are quarantined until the WRITE ended
    landing = _Client(room=2, budget=1800)                          # 113 of the 128 pages
    held = _reserve(decode, landing)
    _tell(prefill, decode, failed_message(2, "did not finish within 1s", may_land=True))
    assert landing.ended.wait(30) and landing.events[-1].status == 500
    assert quarantined == [2]
    waiting = _Client(room=3, budget=len(PROMPT) + 8)               # 19 pages: more than the 15 left
    decode.submit(waiting.req)
    # the quarantined pages stay out of the pool: the next request waits instead of getting them
    with pytest.raises(AssertionError):
        wait_for(waiting.reserved, 1.0, "a reservation that must not happen yet")
    assert pool.used_tokens == len(held) * PAGE and decode.pending()
    _tell(prefill, decode, failed_message(2, "the cancelled KV transfer of bootstrap_room 2 ended"))
    pages = wait_for(waiting.reserved, 30, "room 3's reservation once room 2's quarantine was released")
    assert set(pages) & set(held), "the released pages went back to the pool"
    assert decode.stats.transfer_failed == 2

    # 3. the engine serves on: room 3's KV comes from the real prefill, decoded tokens equal a single process
    _serves_exactly(decode, prefill, waiting, pages)


def _serves_exactly(decode: DecodeEngine, prefill: PrefillEngine, client: _Client, pages: list[int]) -> None:
    """`client`'s request, reserved on decode (`pages`), gets its KV from the real prefill; its tokens equal a single
    process's, and every page on both sides comes back."""
    prefill.destinations.put(client.req.room, decode.transfer.name, pages)   # what decode's reservation posts
    prefill.submit(_Client(room=client.req.room, budget=len(PROMPT) + 8).req)
    assert client.ended.wait(60), client.events
    tokens = [e.token_id for e in client.events if isinstance(e, Token)]
    assert tokens == generate_single_process(_runner(), PROMPT, SamplingParams(max_new_tokens=8, temperature=0), EOS)
    wait_for(lambda: decode.runner.pool.used_tokens == 0 and not decode.pending(), 10,
             "every decode page back, nothing held")
    wait_for(lambda: prefill.runner.pool.used_tokens == 0 and not prefill.reqs, 10, "every prefill page back")


def test_a_room_decode_gave_up_stays_held_through_may_land_until_the_write_ended(sides):
    """Decode gave the room up while it waited (the router's abort): its pages are quarantined. The prefill's WRITE
    then missed its deadline and NIXL could not stop it: its `may_land` message says the WRITE may still land, so
    the pages stay held until the next message for the room (the WRITE ended)."""
    decode, prefill, quarantined = sides
    pool = decode.runner.pool
    gone = _Client(room=4, budget=1800)                             # 113 of the 128 pages
    held = _reserve(decode, gone)
    decode.abort(gone.req.rid)
    assert gone.ended.wait(30) and quarantined == [4]
    _tell(prefill, decode, failed_message(4, "did not finish within 1s", may_land=True))
    waiting = _Client(room=5, budget=len(PROMPT) + 8)               # 19 pages: more than the 15 left
    decode.submit(waiting.req)
    with pytest.raises(AssertionError):
        wait_for(waiting.reserved, 1.5, "a reservation that must not happen while the WRITE may land")
    assert pool.used_tokens == len(held) * PAGE
    _tell(prefill, decode, failed_message(4, "the cancelled KV transfer of bootstrap_room 4 ended"))
    pages = wait_for(waiting.reserved, 30, "room 5's reservation once room 4's WRITE ended")
    assert set(pages) & set(held)
    _serves_exactly(decode, prefill, waiting, pages)   # the engine serves on, in the pages the WRITE could have hit


def test_no_write_starts_after_decode_stopped_waiting_for_it(sides):
    """A prefill that got the reservation, then was frozen (SIGSTOP, a paused VM) past decode's transfer timeout:
    decode failed the request and quarantined the pages, which it hands to another request once the quarantine
    expires. Waking up, the prefill must not start the WRITE into them: it tells decode nothing will come (the
    pages are free at once) and fails its leg."""
    decode, prefill, quarantined = sides
    pool = decode.runner.pool
    late = _Client(room=6, budget=600)
    pages = _reserve(decode, late)
    decode.abort(late.req.rid)                                      # decode's transfer timeout, in short
    assert late.ended.wait(30) and quarantined == [6]
    prefill.destinations.put(6, decode.transfer.name, pages, waits_s=0.05)   # what decode's reservation said
    threading.Event().wait(0.2)                                     # the prefill was frozen past it
    leg = _Client(room=6, budget=600)
    prefill.submit(leg.req)
    assert leg.ended.wait(60) and isinstance(leg.events[-1], Failed), leg.events
    assert "decode stopped waiting for the KV of bootstrap_room 6" in leg.events[-1].message
    wait_for(lambda: pool.used_tokens == 0 and not decode.pending(), 10, "decode's quarantined pages freed at once")
    after = _Client(room=7, budget=len(PROMPT) + 8)
    _serves_exactly(decode, prefill, after, _reserve(decode, after))   # and serves on
