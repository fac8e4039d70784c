"""The prefill engine keeps each request in the queue of its state (workers/prefill/engine.py): waiting while its
prompt is computed, then peer once its KV is ready, and out of both once it fails; the stranded-KV scan reads the
peer queue's ready times."""

from __future__ import annotations

import pytest

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.request import Failed, Req, ReqState
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.prefill.engine import PrefillEngine


def _room(rid: str) -> int:
    """A bootstrap room per rid, the same in every run (`hash(rid) % 1000`, salted per process, let two rids of a
    test share a room now and then, which makes one reserved when the test means it not to be)."""
    return sum(map(ord, rid))


def _engine() -> PrefillEngine:
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=1024, context_length=512))
    return PrefillEngine(runner, transfer=None, peer_timeout_s=0.0, chunk_tokens=40, prefix_cache=False)


def _submit(engine: PrefillEngine, rid: str, n: int, events: list) -> Req:
    req = Req(rid=rid, prompt_ids=[10 + i % 250 for i in range(n)], budget=n + 2, emit=events.append, room=_room(rid),
              params=SamplingParams(max_new_tokens=2, temperature=0))
    engine.reqs[rid] = req
    engine.on_submit(req)
    return req


def _three_computed(events: list) -> tuple[PrefillEngine, list[Req]]:
    """An engine (stranded deadline 60 s) holding three computed 300-token prompts, a, b and c, for rooms no decode
    has reserved: 19 pages each, 57 of its 64."""
    engine = _engine()
    engine.peer_timeout_s = engine.stranded.timeout_s = 60.0
    done = [_submit(engine, rid, 300, events) for rid in ("a", "b", "c")]
    while engine._prefill_batch():
        pass
    assert list(engine.peer) == done
    return engine, done


def test_a_request_sits_in_the_queue_its_state_names_and_leaves_both_when_it_fails():
    engine, events = _engine(), []
    long, short = _submit(engine, "long", 60, events), _submit(engine, "short", 8, events)
    engine._prefill_batch()                        # 40 tokens: part of `long`, `short` waits for the next step
    assert long.state is short.state is ReqState.WAITING_PAGES and list(engine.waiting) == [long, short]
    assert 0 < long.prefilled < 60 and short.prefilled == 0
    engine._prefill_batch()
    assert list(engine.waiting) == [] and list(engine.peer) == [long, short]
    assert long.state is short.state is ReqState.WAITING_PEER and len(long.out) == 1
    engine.fail(short, 499, "aborted by request")
    assert list(engine.peer) == [long] and short.state is ReqState.ABORTED and short.pages == []
    engine._free_stranded()                        # peer_timeout_s 0: its KV is stranded at once and freed
    assert len(engine.peer) == 0 and long.pages == [] and engine.stranded.freed_rooms == 1
    assert [e.status for e in events if isinstance(e, Failed)] == [499, 500]
    assert engine.runner.pool.free_pages == engine.runner.pool.layout.num_pages


def test_a_room_decode_reserved_gets_pages_from_prompts_no_decode_reserved_yet():
    """Both pools full, each waiting on the other (seen by the KV review on a real pair: 6-8 of 8 requests failed
    after 80 s): the prefill's pool held computed KV for rooms the decode had not reserved, while the decode's held
    reservations for prompts the prefill had no pages to compute. A reserved room now goes first and takes the pages
    of the latest unreserved prompt, which is computed again later, with the same first token; its stranded-KV
    deadline still counts from its first computation (it started again, so a prompt given up again and again
    was never stranded)."""
    events: list = []
    engine, done = _three_computed(events)
    first_c, ready_c = done[2].out[0], dict(engine.peer.items())[done[2]]
    waiting, reserved = _submit(engine, "e", 300, events), _submit(engine, "d", 300, events)
    engine.destinations.put(reserved.room, "decode-agent", list(range(19)))   # decode reserved d, not e
    assert engine._prefill_batch()                 # the previous code stopped at e: no pages, nothing computed
    while engine._prefill_batch():
        pass
    assert list(engine.peer) == done[:2] + [reserved] and len(reserved.out) == 1
    assert list(engine.waiting) == [waiting, done[2]] and done[2].pages == [] and done[2].prefilled == 0
    for req in done[:2]:                           # their WRITEs ended: c is computed again
        engine.peer.pop(req)
        engine.release(req)
    while engine._prefill_batch():
        pass
    assert done[2] in engine.peer and done[2].out == [first_c]
    assert dict(engine.peer.items())[done[2]] == ready_c < engine.now()
    assert not [e for e in events if isinstance(e, Failed)]


@pytest.mark.parametrize("reserved_since", [False, True], ids=["unreserved", "reserved while it waits"])
def test_a_prompt_given_up_for_a_reserved_room_fails_where_it_waits_once_its_deadline_passed(reserved_since):
    """A prompt that gave its pages up keeps the stranded deadline of its first computation; it was failed only once
    it had been computed again (its decode long gone, the compute wasted). Now it fails where it waits, with the
    stranded-KV message; a prompt never computed is not touched, nor one whose decode reserved its room since."""
    events: list = []
    engine, done = _three_computed(events)
    ready_c = dict(engine.peer.items())[done[2]]
    never, reserved = _submit(engine, "e", 300, events), _submit(engine, "d", 300, events)
    engine.destinations.put(reserved.room, "decode-agent", list(range(19)))
    while engine._prefill_batch():                 # d takes c's pages
        pass
    assert list(engine.waiting) == [never, done[2]] and done[2].first_ready == ready_c
    for req in done[:2] + [reserved]:              # their WRITEs ended
        engine.peer.pop(req)
        engine.release(req)
    if reserved_since:
        engine.destinations.put(done[2].room, "decode-agent", list(range(19)))
    engine.now = lambda: ready_c + 59.0
    engine._free_stranded()
    assert list(engine.waiting) == [never, done[2]] and not [e for e in events if isinstance(e, Failed)]
    engine.now = lambda: ready_c + 60.0
    engine._free_stranded()
    if reserved_since:                             # its decode came: it is computed again and sent, not failed
        assert list(engine.waiting) == [never, done[2]] and not [e for e in events if isinstance(e, Failed)]
        return
    assert list(engine.waiting) == [never] and done[2].state is ReqState.ABORTED and done[2].prefilled == 0
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and failed[0].status == 500 and f"bootstrap_room {done[2].room}" in failed[0].message
    assert engine.stranded.freed_rooms == 1 and engine.stats.bootstrap_failed == 1


def test_a_prompt_computed_in_part_goes_on_while_a_room_decode_reserved_waits_for_pages():
    """A long prompt no decode reserved yet was computed in part (it holds its pages) when a reserved room came that
    the rest of the pool cannot hold, and no computed prompt could give it pages: the reserved room went first,
    found no pages and stopped the step, so the long prompt never went on and both pools waited on each other until
    decode's timeout failed the reserved room. The long prompt goes on now; once computed it gives its pages up."""
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=768, context_length=512))
    engine, events = PrefillEngine(runner, transfer=None, peer_timeout_s=60.0, chunk_tokens=40, prefix_cache=False), []
    long = _submit(engine, "long", 500, events)                     # 32 of 48 pages
    engine._prefill_batch()
    assert 0 < long.prefilled < 500
    reserved = _submit(engine, "r", 300, events)                    # 19 pages: 16 free
    engine.destinations.put(reserved.room, "decode-agent", list(range(19)))
    for _ in range(40):
        if not engine._prefill_batch():
            break
    assert list(engine.peer) == [reserved] and len(reserved.out) == 1
    assert list(engine.waiting) == [long] and long.pages == [] and long.prefilled == 0
    assert not [e for e in events if isinstance(e, Failed)]


def test_a_prompt_computed_again_reports_the_cache_it_found_when_first_computed_not_its_own_pages():
    """A prompt that gave its pages up to a reserved room is computed again. A later prompt that shares its first
    10 pages (a conversation's next turn) keeps those in the prefix cache, so the second computation finds them:
    the client's `cached_tokens` and the cache's hit counters said 160 tokens came from the cache, for a prompt
    nothing had cached when it came. They count the cache a prompt found the first time, once."""
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=1024, context_length=512))
    engine, events = PrefillEngine(runner, transfer=None, peer_timeout_s=60.0, chunk_tokens=40), []

    def submit(rid: str, prompt: list[int]) -> Req:
        req = Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=2, temperature=0), budget=302,
                  emit=events.append, room=_room(rid))
        engine.reqs[rid] = req
        engine.on_submit(req)
        return req

    prompts = [[5 + (first + i) % 240 for i in range(300)] for first in range(3)]   # no two share a page
    done = [submit(rid, p) for rid, p in zip("abc", prompts)]     # 19 pages each: 57 of 64
    while engine._prefill_batch():
        pass
    assert [r.cached_tokens for r in done] == [0, 0, 0] and engine.cache.cached_tokens_total == 0
    c = done[2]
    turn2 = submit("c2", c.prompt_ids[:160] + [7] * 140)         # 10 of c's pages, then 9 of its own
    engine.destinations.put(turn2.room, "decode-agent", list(range(19)))   # decode reserved it, not c
    while engine._prefill_batch():
        pass
    assert c.pages == [] and c in engine.waiting and turn2.cached_tokens == 160   # c gave its pages up
    for req in done[:2]:
        engine.peer.pop(req)
        engine.release(req)
    while engine._prefill_batch():
        pass
    assert c in engine.peer and c.prefilled == 300
    assert c.cached_tokens == 0 and engine.cache.cached_tokens_total == 160   # turn2's hit only
    assert not [e for e in events if isinstance(e, Failed)]


def test_no_prompt_gives_its_pages_up_when_all_of_theirs_would_not_make_room():
    """A reserved room the pool cannot hold even once every unreserved prompt gave its pages up: each such prompt
    gave them up anyway (its KV thrown away, computed again for nothing) before the room found the pool short.
    They keep their pages now; the room waits."""
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=1024, context_length=512))
    engine, events = PrefillEngine(runner, transfer=None, peer_timeout_s=60.0, chunk_tokens=40, prefix_cache=False), []
    held = [_submit(engine, rid, 300, events) for rid in ("b", "c", "e")]   # 19 pages each, reserved by decode
    for req in held:
        engine.destinations.put(req.room, "decode-agent", list(range(19)))
    small = _submit(engine, "a", 80, events)                                # 5 pages, not reserved: 62 of 64 held
    while engine._prefill_batch():
        pass
    assert {r.rid for r in engine.peer} == {"a", "b", "c", "e"} and engine.runner.pool.free_pages == 2
    room = _submit(engine, "d", 300, events)                                # 19 pages: 2 free + a's 5 are 7
    engine.destinations.put(room.room, "decode-agent", list(range(19)))
    assert not engine._prefill_batch()
    assert small in engine.peer and len(small.pages) == 5 and len(small.out) == 1 and small.first_ready is None
    assert list(engine.waiting) == [room] and room.pages == [] and engine.runner.pool.free_pages == 2
    assert not [e for e in events if isinstance(e, Failed)]


def test_prompts_sharing_cached_pages_give_them_up_together_when_that_makes_room():
    """Unreserved prompts fill the pool but for 2 pages, three sharing a 25-page system prompt in the prefix cache and
    two a 10-page one; a reserved room needs 32 pages. A shared page comes free only once all its holders give it up,
    and the check that all of theirs make room counted it for none of them: the room waited, both pools full, until
    the stranded deadline failed the prompts."""
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=768, context_length=512))
    engine, events = PrefillEngine(runner, transfer=None, peer_timeout_s=60.0, chunk_tokens=400), []

    def submit(rid: str, prompt: list[int]) -> Req:
        req = Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=2, temperature=0),
                  budget=len(prompt) + 2, emit=events.append, room=_room(rid))
        engine.reqs[rid] = req
        engine.on_submit(req)
        while engine._prefill_batch():
            pass
        return req

    def tokens(n: int, first: int) -> list[int]:
        return [10 + (first + 7 * i) % 250 for i in range(n)]

    system, other = tokens(400, 0), tokens(160, 1)
    victims = [submit(f"v{i}", system + tokens(40, 10 + i)) for i in range(3)]
    victims += [submit(f"w{i}", other + tokens(8, 20 + i)) for i in range(2)]
    assert engine.runner.pool.free_pages == 2 and {r.rid for r in engine.peer} == {r.rid for r in victims}
    room = Req(rid="d", prompt_ids=tokens(500, 3), params=SamplingParams(max_new_tokens=2, temperature=0), budget=502,
               emit=events.append, room=1)
    engine.reqs["d"] = room
    engine.on_submit(room)
    engine.destinations.put(room.room, "decode-agent", list(range(32)))
    while engine._prefill_batch():
        pass
    assert room in engine.peer and len(room.pages) == 32 and len(room.out) == 1
    assert not [e for e in events if isinstance(e, Failed)]
