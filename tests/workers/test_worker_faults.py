"""Faults in a real embedded prefill + decode pair: a peer killed and started again on the same ports
(same NIXL agent name, new memory), poison sampling values, an engine thread that dies. Each test
sends requests after the fault and checks their answers."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import signal
import time

import httpx
import pytest

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.http.serving import QuietPolls
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

from tests.helpers import SOON_S, kv_used, wait_for
from tests.worker_procs import restart, start_pair, stop_pair

TOK = ByteTokenizer()
PROMPT = "after the fault"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = start_pair(tmp_path_factory.mktemp("faults"), extra=["--test-hooks"],
                   prefill_extra=["--peer-timeout-s", "3"], decode_extra=["--transfer-timeout-s", "3"])
    yield p
    stop_pair(p)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=4096,
                                      context_length=1024))
    return generate_single_process(runner, TOK.encode(PROMPT), SamplingParams(max_new_tokens=8, temperature=0),
                                   EOS)


async def _both(pair, body: dict, timeout: float = 60) -> tuple[httpx.Response, httpx.Response]:
    body = {**body, **pair.bootstrap(secrets.randbits(63), secrets.token_hex(8))}
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await asyncio.gather(c.post(pair.prefill_url + "/generate", json=body),
                                    c.post(pair.decode_url + "/generate", json=body))


def _greedy(text: str = PROMPT, n: int = 8) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def _serves(pair, expected: list[int], count: int = 20) -> None:
    """`count` requests, four at a time, each answered 200 on both legs with the single-process tokens."""
    async def run():
        out = []
        for _ in range(count // 4):
            out += await asyncio.gather(*(_both(pair, _greedy()) for _ in range(4)))
        return out

    for p, d in asyncio.run(run()):
        assert (p.status_code, d.status_code) == (200, 200), (p.text, d.text)
        assert d.json()["output_ids"] == expected


async def _kill_while_running(pair, index: int) -> list[tuple[object, object]]:
    """Send a request every 0.2 s for 2 s and SIGKILL worker `index` after 1 s; returns each
    request's (prefill leg, decode leg): a Response or the exception the client saw."""
    async def legs(c: httpx.AsyncClient) -> tuple[object, object]:
        body = {"text": "in flight", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
                **pair.bootstrap(secrets.randbits(63), secrets.token_hex(8))}
        return tuple(await asyncio.gather(c.post(pair.prefill_url + "/generate", json=body),
                                          c.post(pair.decode_url + "/generate", json=body),
                                          return_exceptions=True))

    async with httpx.AsyncClient(timeout=40) as c:
        tasks = []
        for i in range(10):
            tasks.append(asyncio.ensure_future(legs(c)))
            if i == 5:
                pair.procs[index].send_signal(signal.SIGKILL)
            await asyncio.sleep(0.2)
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("index", [1, 0], ids=["decode", "prefill"])
def test_a_worker_killed_under_load_and_started_again_serves_the_next_20(pair, expected, index):
    _serves(pair, expected, count=4)
    started = time.monotonic()
    legs = asyncio.run(_kill_while_running(pair, index))
    assert time.monotonic() - started < 30, "a leg hung after its peer died"
    survivor = pair.procs[1 - index]
    assert survivor.poll() is None, "the surviving worker died with its peer"
    answered = [leg[1 - index] for leg in legs]
    assert all(isinstance(r, httpx.Response) for r in answered), answered   # no hang, no reset
    assert any(r.status_code != 200 for r in answered), "the kill hit no request"
    restart(pair, index)
    _serves(pair, expected)
    assert kv_used(pair.prefill_url) == 0


@pytest.mark.parametrize("field, value, words", [
    ("temperature", math.nan, "temperature"), ("temperature", math.inf, "temperature"),
    ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_p", math.nan, "top_p"), ("max_new_tokens", 0, "max_new_tokens"),
])
def test_poison_sampling_values_get_a_400_naming_the_field(pair, expected, field, value, words):
    body = {"text": "poison", "sampling_params": {"max_new_tokens": 4, field: value},
            **pair.bootstrap(secrets.randbits(63), "p1")}
    # httpx refuses NaN/inf in json=; send the JSON text Python writes (NaN, Infinity), as clients do
    raw = json.dumps(body)
    for url in (pair.prefill_url, pair.decode_url):
        r = httpx.post(url + "/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
    _serves(pair, expected, count=4)


@pytest.mark.parametrize("path, prompt, field", [
    ("/v1/completions", {"model": "dsv4-tiny", "prompt": [999999999], "max_tokens": 4}, "prompt"),
    ("/generate", {"input_ids": [3, -1], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
])
def test_an_unusable_prompt_gets_a_400_naming_the_field_the_client_sent(pair, expected, path, prompt, field):
    """A completions prompt of ids out of the vocabulary was refused as "input_ids must be ...", a field the client
    never sent."""
    for url in (pair.prefill_url, pair.decode_url):
        r = httpx.post(url + path, json={**prompt, **pair.bootstrap(secrets.randbits(63), "p1")})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{field}: the prompt must be a non-empty list"), r.text
    _serves(pair, expected, count=4)


def test_tiny_positive_temperature_is_greedy_as_in_sglang(pair, expected):
    """SGLang 0.5.23's SamplingParams turns temperature < 1e-6 into greedy; so do we."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 1e-40}}
    p, d = asyncio.run(_both(pair, body))
    assert (p.status_code, d.status_code) == (200, 200), (p.text, d.text)
    assert d.json()["output_ids"] == expected
    _serves(pair, expected, count=4)


def test_a_dead_engine_thread_ends_the_process_non_zero(pair, expected):
    for index, url in ((1, pair.decode_url), (0, pair.prefill_url)):
        proc = pair.procs[index]
        r = httpx.post(url + "/debug/kill_engine", timeout=10)
        assert r.status_code == 200, r.text
        assert proc.wait(15) not in (0, None)
        assert "engine thread died" in pair.logs[index].read_text()
        restart(pair, index)
        _serves(pair, expected, count=4)


def test_test_hooks_are_off_unless_asked_for():
    from dsv4_cluster.workers.args import parse_args
    from dsv4_cluster.workers.decode.server import DecodeServer
    from dsv4_cluster.workers.http.routes import build_app

    def paths(argv: list[str]) -> set[str]:
        return {r.path for r in build_app(DecodeServer(parse_args("decode", argv))).routes}

    assert "/debug/kill_engine" not in paths([])
    assert "/debug/kill_engine" in paths(["--test-hooks"])


def test_a_peer_with_new_metadata_is_reloaded_and_its_old_reservations_refused():
    """Real NIXL agents in one process: "d" restarts (same name, new pool); the prefill side reloads it,
    refuses a WRITE into pages the old process reserved, and WRITEs into the new process's memory."""
    from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
    from dsv4_cluster.workers.kv.transfer import NixlTransfer, TransferError

    layout = PoolLayout(page_size=4, num_pages=4, n_layers=1, head_dim=8, index_dim=4, ratio=4, dtype="float32")
    src = KVPool(layout)
    src.main[0].fill_(3.0)
    prefill = NixlTransfer("p-unit", src)
    old = NixlTransfer("d-unit", KVPool(layout))
    assert prefill.add_peer(old.local_info()) == prefill.add_peer(old.local_info()) == 1
    new_pool = KVPool(layout)
    new = NixlTransfer("d-unit", new_pool)
    assert prefill.add_peer(new.local_info()) == 2 == prefill.incarnation("d-unit")
    with pytest.raises(TransferError, match="restarted after it reserved"):
        prefill.write_pages("d-unit", [0], [1], b"room-1", incarnation=1)
    handle = prefill.write_pages("d-unit", [0], [1], b"room-2", incarnation=2)
    notifs: list[bytes] = []

    def written() -> str | None:
        # No UCX progress thread (transfer.py): both sides make progress only while polled, as engine loops do.
        notifs.extend(new.notifications())
        return None if (state := prefill.poll(handle)) == "PROC" else state
    assert wait_for(written, 10, "the WRITE into the restarted decode", interval_s=0.01) == "DONE"
    assert new_pool.main[0][4:8].eq(3.0).all() and new_pool.main[0][:4].eq(0).all()
    if not notifs:
        notifs = wait_for(new.notifications, 10, "the WRITE's notification", interval_s=0)
    assert notifs == [b"room-2"]


def test_one_failing_request_fails_alone_and_the_engine_goes_on():
    """The real engine loop with a step that raises for one request (a stand-in for any bug that
    one request's values trigger)."""
    from dsv4_cluster.workers.engine.loop import Engine
    from dsv4_cluster.workers.engine.request import Failed, Req, Token

    class Echo(Engine):
        def __init__(self):
            super().__init__(runner=None, name="echo")
            self.todo: list[Req] = []

        def on_submit(self, req):
            self.todo.append(req)

        def step(self):
            worked = bool(self.todo)
            for req in self.todo:
                with self.serving(req):
                    if req.prompt_ids == [0]:
                        raise FloatingPointError("sampling on NaN")
                    req.emit(Token(req.prompt_ids[0], "length"))
                    self.reqs.pop(req.rid)
            self.todo.clear()
            return worked

    events: dict[str, list] = {}
    engine = Echo()
    engine.start()
    try:
        for rid, ids in (("bad", [0]), ("good", [7])):
            events[rid] = []
            engine.submit(Req(rid=rid, prompt_ids=ids, params=SamplingParams(), budget=8,
                              emit=events[rid].append))
        wait_for(lambda: events["bad"] and events["good"], SOON_S, "both requests answered")
        assert isinstance(events["bad"][0], Failed) and events["bad"][0].status == 500
        assert "sampling on NaN" in events["bad"][0].message
        assert events["good"] == [Token(7, "length")]
        assert engine.alive and engine.stats.internal_errors == 1 and not engine.reqs
    finally:
        engine.stop()


def test_sampling_values_follow_sglang():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_health_and_metrics_polls_leave_no_access_lines_but_errors_and_requests_do(pair, expected):
    for _ in range(3):
        for url in (pair.prefill_url, pair.decode_url):
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(pair.decode_url + "/health/nothing-here", timeout=10).status_code == 404
    _serves(pair, expected, count=4)
    time.sleep(0.5)  # the workers' log lines reach their files
    prefill_log, decode_log = (log.read_text() for log in pair.logs)
    for text in (prefill_log, decode_log):
        assert '"GET /health HTTP/1.1" 200' not in text and '"GET /metrics HTTP/1.1" 200' not in text
        assert '"POST /generate HTTP/1.1" 200' in text
    assert '"GET /health/nothing-here HTTP/1.1" 404' in decode_log
    quiet = QuietPolls()
    failed = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", "/health", "1.1", 503), None)
    assert quiet.filter(failed)  # a failing health check stays in the log
