"""Every in-flight KV write has a deadline (topology `transfer.write_timeout_s`): on expiry the write is cancelled,
the request fails with a clear error, decode is told, the counter rises, and no page is left behind.

The stalled write is real: the prefill engine (real model runner, real NIXL agent over UCX's tcp transport) WRITEs
into a decode agent in the same process that is never progressed (what a frozen or dead decode looks like to
UCX: the rendezvous is never answered). The branch where NIXL refuses to cancel is driven through a stand-in
transfer, since UCX cancels every write it was asked to here.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from dsv4_cluster.metric_names import KV_WRITE_TIMEOUTS
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.core import Role
from dsv4_cluster.workers.http.metrics import WorkerMetrics
from dsv4_cluster.workers.prefill import engine as prefill_engine
from dsv4_cluster.workers.prefill.engine import PrefillEngine
from dsv4_cluster.workers.engine.request import Failed, Req, Token
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.kv.transfer import NixlTransfer, XferState, page_runs
from tests.helpers import wait_for

PAGE = 16


def _runner() -> ModelRunner:
    return ModelRunner(RunnerConfig(model=ModelConfig(), page_size=PAGE, max_total_tokens=2048, context_length=1024))


def _req(room: int, events: list, done: threading.Event) -> Req:
    def emit(event):
        events.append(event)
        if isinstance(event, (Failed, Token)):
            done.set()

    prompt = [40 + i % 50 for i in range(300)]
    return Req(rid=f"r{room}", prompt_ids=prompt, params=SamplingParams(max_new_tokens=4, temperature=0),
               budget=len(prompt) + 4, emit=emit, room=room)


@pytest.fixture
def tcp_only(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")   # a WRITE over tcp needs the target's progress to finish


def test_a_write_into_a_frozen_decode_is_cancelled_at_its_deadline_and_frees_everything(tcp_only):
    runner = _runner()
    prefill = NixlTransfer(f"wd-prefill-{os.getpid()}", runner.pool)
    frozen = NixlTransfer(f"wd-decode-{os.getpid()}", _runner().pool)    # never polled: the decode is frozen
    engine = PrefillEngine(runner, prefill, peer_timeout_s=30, write_timeout_s=1.0)
    prefill.add_peer(frozen.local_info())
    engine.start()
    try:
        events, done = [], threading.Event()
        req = _req(7, events, done)
        engine.destinations.put(7, frozen.name, list(range(40)))   # what decode's reservation posts
        t0 = time.monotonic()
        engine.submit(req)
        assert done.wait(30), "the request never ended"
        took = time.monotonic() - t0
        failed = [e for e in events if isinstance(e, Failed)]
        assert failed and failed[0].status == 500 and not any(isinstance(e, Token) for e in events)
        assert "did not finish within 1s" in failed[0].message and "transfer.write_timeout_s" in failed[0].message
        assert 1.0 <= took < 10
        wait_for(lambda: runner.pool.used_tokens == 0, 5, "every page back")
        assert runner.pool.used_tokens == 0 and engine.reqs == {}    # every page back, nothing held
        assert engine.stats.write_timeouts == 1 and engine.stats.transfer_failed == 1
        exposition = WorkerMetrics(engine, "dsv4-tiny", Role.PREFILL, 1024).render().decode()   # what /metrics serves
        assert re.search(rf"^{KV_WRITE_TIMEOUTS}{{[^}}]*}} 1\.0$", exposition, re.MULTILINE), exposition
        assert engine.destinations.done(7) is None                  # the room is no longer taken
        # the decode side is told: once both agents make progress again (no progress threads: the engines' loops
        # drive it), the decode finds the room failed, and not "may land": NIXL cancelled the write
        def told() -> list[dict]:
            prefill.notifications()
            return [json.loads(m) for m in frozen.notifications()]
        msgs = wait_for(told, 10, "the decode to be told the room failed", interval_s=0)
        assert msgs and msgs[0]["room"] == 7 and "did not finish within" in msgs[0]["failed"]
        assert "may_land" not in msgs[0]
        # the engine serves on: the next request's write into a live decode succeeds
        events2, done2 = [], threading.Event()
        engine.destinations.put(8, frozen.name, list(range(40, 80)))
        engine.submit(_req(8, events2, done2))
        def served() -> bool:
            frozen.notifications()                                   # now the decode progresses
            return done2.is_set()
        wait_for(served, 30, "the next request's write into the live decode", interval_s=0)
        assert [type(e).__name__ for e in events2] == ["Token"]
    finally:
        engine.stop()


class _StuckTransfer:
    """A transfer whose WRITE never finishes and that NIXL refuses to cancel, until `end` is set."""

    def __init__(self):
        self.end = False
        self.sent: list[tuple[str, dict]] = []

    def write_pages(self, *a, **k):
        return object()

    def poll(self, handle):
        return XferState.DONE if self.end else XferState.PROC

    def abandon(self, handle):
        return False

    def notify(self, peer, message):
        self.sent.append((peer, json.loads(message)))

    def progress(self):
        pass


def test_pages_a_write_may_still_read_stay_out_of_the_pool_until_nixl_lets_go(monkeypatch):
    monkeypatch.setattr(prefill_engine, "NOTIFY_PROGRESS_S", 0.0)   # pending() then means the abandoned write
    runner = _runner()
    transfer = _StuckTransfer()
    engine = PrefillEngine(runner, transfer, write_timeout_s=0.2)
    events, done = [], threading.Event()
    req = _req(9, events, done)
    engine.destinations.put(9, "dec", list(range(40)))
    engine.on_submit(req)
    engine.reqs[req.rid] = req
    def ended() -> bool:
        engine.step()
        return done.is_set()
    wait_for(ended, 30, "the request to fail (its WRITE stuck)", interval_s=0)
    assert isinstance(events[-1], Failed) and "did not finish within 0.2s" in events[-1].message
    held = runner.pool.used_tokens
    assert held == 304                                  # 19 pages of 16 tokens: NIXL may still read them
    assert transfer.sent[-1][1]["may_land"] is True     # decode holds its pages too
    assert engine.destinations.agent_of(9) == "dec"     # decode's /kv/cancel hears "a write may be in flight"
    assert engine.pending()                             # the loop keeps polling the abandoned write
    engine.step()
    assert runner.pool.used_tokens == held
    transfer.end = True
    engine.step()
    assert runner.pool.used_tokens == 0 and not engine.pending()
    assert transfer.sent[-1][1]["room"] == 9 and "ended" in transfer.sent[-1][1]["failed"]
    assert engine.destinations.agent_of(9) is None


def test_the_prefill_role_captures_no_decode_graphs_and_takes_the_write_deadline():
    """A prefill never decodes: its runner is built without CUDA graphs (start-up time and GPU memory), whatever
    --cuda-graph-max-bs says; a decode keeps them. The topology's write deadline reaches the prefill's engine."""
    from dsv4_cluster.workers.args import parse_args
    from dsv4_cluster.workers.decode.server import DecodeServer
    from dsv4_cluster.workers.prefill.server import PrefillServer

    argv = ["--device", "cpu", "--cuda-graph-max-bs", "32"]
    boot = ["--disaggregation-bootstrap-port", "8998"]
    prefill = PrefillServer(parse_args("prefill", [*argv, *boot, "--write-timeout-s", "7"]))
    assert prefill.runner_config().cuda_graph_max_bs == 0 and prefill.args.write_timeout_s == 7.0
    assert DecodeServer(parse_args("decode", argv)).runner_config().cuda_graph_max_bs == 32
    with pytest.raises(SystemExit):
        parse_args("prefill", [*boot, "--write-timeout-s", "0"])


class _Recorder(_StuckTransfer):
    """A transfer that records each WRITE's pages and ends it at once."""

    def __init__(self):
        super().__init__()
        self.end, self.writes = True, []

    def write_pages(self, peer, src, dst, notif, incarnation=None):
        self.writes.append((list(src), list(dst)))
        return object()


def test_a_prefill_that_allocates_after_decode_reserved_breaks_its_pages_where_decodes_break():
    """Decode reserved 19 pages as runs of 9 and 10; this pool's free runs are 12 and 10 pages long. Blind, the
    prefill would take 12 + 7 and the WRITE would be 3 descriptors; following decode's runs it is 2."""
    runner = _runner()
    pool, transfer = runner.pool, _Recorder()
    held = pool.alloc(pool.capacity_tokens)
    pool.release([p for p in held if p < 12 or 50 <= p < 60])
    engine = PrefillEngine(runner, transfer, write_timeout_s=5)
    dst = [*range(200, 209), *range(300, 310)]
    engine.destinations.put(11, "dec", dst)
    events, done = [], threading.Event()
    req = _req(11, events, done)
    engine.on_submit(req)
    engine.reqs[req.rid] = req
    wait_for(lambda: (engine.step(), transfer.writes)[1], 30, "the request's WRITE", interval_s=0)
    (src, to), = transfer.writes
    assert to == dst and src == [*range(0, 9), *range(50, 60)]
    assert len(page_runs(src, to)) == 2
