"""The prefill engine keeps each request in the queue of its state (workers/prefill/engine.py): waiting while its
prompt is computed, then peer once its KV is ready, and out of both once it fails; the stranded-KV scan reads the
peer queue's ready times."""

from __future__ import annotations

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.request import Failed, Req, ReqState
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.prefill.engine import PrefillEngine


def _engine() -> PrefillEngine:
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=1024, context_length=512))
    return PrefillEngine(runner, transfer=None, peer_timeout_s=0.0, chunk_tokens=40, prefix_cache=False)


def _submit(engine: PrefillEngine, rid: str, n: int, events: list) -> Req:
    req = Req(rid=rid, prompt_ids=list(range(10, 10 + n)), params=SamplingParams(max_new_tokens=2, temperature=0),
              budget=n + 2, emit=events.append, room=hash(rid) % 1000)
    engine.reqs[rid] = req
    engine.on_submit(req)
    return req


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
