"""What a client may read when a worker fails (router/public.py, relay.py, generation.py): roles, never a worker's
name, host, port, URL or agent name; an error event before any content is a failed attempt (retried, else a
status in the OpenAI envelope), one after it is rewritten and the stream ends with `[DONE]`; a router bug is a
500 in the envelope with a request id (or an error event + `[DONE]` mid-stream), never the exception's text."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from dsv4_cluster.router import generation
from dsv4_cluster.router.upstream import worker_failed
from dsv4_cluster.router.errors import NoWorkers
from dsv4_cluster.router.pool import WorkerPool
from dsv4_cluster.router.public import Redactor, scrub
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.worker import Worker
from dsv4_cluster.core import Role, WorkerState

from tests.router_fakes import LEAKY, MESSAGES, WAIT_S
from tests.router_fakes import Cluster

SECRETS = ("gpu-node-7", "8998", "30001", "http", "decode-gpu", "decode-0", "prefill-0", "127.0.0.1", "internal\"")


def post(url: str, stream: bool) -> tuple[int, str, bytes]:
    """Status, content type and every byte of the answer."""
    body = {"messages": MESSAGES, "stream": stream}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=WAIT_S) as resp:
        return resp.status_code, resp.headers["content-type"], resp.read()


def assert_clean(raw: bytes) -> None:
    leaked = [s for s in SECRETS if s.encode() in raw]
    assert not leaked, (leaked, raw)


def events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_an_error_event_before_any_content_is_retried_on_a_fresh_pair(cluster: Cluster) -> None:
    cluster.reset(decode="error_first_once")
    status, kind, raw = post(cluster.router.url, stream=True)
    assert status == 200 and kind.startswith("text/event-stream")
    assert b'"error"' not in raw
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events(raw)[:-1]) == "tok0 tok1 "
    assert events(raw)[-1] == "[DONE]" and len(cluster.decode.received) == 2


def test_an_error_event_before_any_content_that_stays_is_a_502_in_the_envelope(cluster: Cluster) -> None:
    cluster.reset(decode="error_first")
    status, kind, raw = post(cluster.router.url, stream=True)
    assert (status, kind) == (502, "application/json"), raw      # not a 200 carrying the worker's raw event
    error = json.loads(raw)["error"]
    assert error == {"message": "the decode worker failed this request (500)", "type": "upstream_error", "code": 502}
    assert_clean(raw)
    assert len(cluster.decode.received) == 1 + cluster.settings.max_retries


def test_an_error_event_mid_stream_is_rewritten_and_the_stream_ends_with_done(cluster: Cluster) -> None:
    cluster.reset(decode="error_mid")
    status, _, raw = post(cluster.router.url, stream=True)
    data = events(raw)
    assert status == 200 and data[-1] == "[DONE]" and "tok1" in data[-3]
    assert json.loads(data[-2]) == {"error": {"message": "the decode worker failed this request (500)",
                                              "type": "upstream_error", "code": 502}}
    assert_clean(raw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_router_bug_is_a_500_with_a_request_id_never_the_exception(cluster: Cluster, monkeypatch,
                                                                        stream: bool) -> None:
    def boom(*_):
        raise RuntimeError("secret state at http://127.0.0.1:8998")
    cluster.reset()
    # streaming: after the 200 went out, before the first event's bytes; plain: before D's answer is passed on
    monkeypatch.setattr(*(generation.Flight, "token_sent") if stream else (generation.logprobs, "wanted"), boom)
    status, kind, raw = post(cluster.router.url, stream=stream)
    assert b"secret" not in raw and b"RuntimeError" not in raw
    if stream:
        assert (status, events(raw)[-1]) == (200, "[DONE]")
    else:
        assert (status, kind) == (500, "application/json")
    error = json.loads(events(raw)[-2] if stream else raw)["error"]
    assert error["code"] == 500 and "request id" in error["message"] and error["type"] == "internal_error"


def test_the_redactor_knows_this_routers_names_and_hosts_and_every_address_shape() -> None:
    redact = Redactor(["decode-0", "prefill-0"], ["http://gpu-node-7:30001"], ["gpu-node-7", None])
    text = redact.scrub(LEAKY["error"]["message"] + " (decode-0 on gpu-node-7, [fe80::1]:80, 2001:db8::1, "
                        "10.0.0.7:30001, localhost, my-host.example:8080, port 8998)")
    assert_clean(text.encode())
    for shape in ("fe80", "2001", "10.0.0.7", "localhost", "example"):
        assert shape not in text, (shape, text)
    assert "KV bootstrap failed" in text and redact.scrub("kvm is not vm") == "kvm is not vm"
    assert scrub("decode worker 'decode-0' at http://h:1/x") == "the decode worker at (internal)"


def test_a_workers_4xx_keeps_its_words_without_names_and_its_5xx_says_only_role_and_status() -> None:
    worker = Worker(Role.DECODE, "decode-gpu-node-7", "http://gpu-node-7:30001")
    redact = Redactor([worker.name], [worker.url], [])
    bad = worker_failed(worker, 400, "prompt of 9000 tokens is too long for gpu-node-7:30001", redact)
    assert (bad.status, bad.body()["error"]["message"]) == (400, "prompt of 9000 tokens is too long for (internal)")
    broken = worker_failed(worker, 500, "agent decode-gpu-node-7-30001 lost", redact)
    assert broken.status == 502 and broken.retryable
    assert broken.body()["error"]["message"] == "the decode worker failed this request (500)"
    busy = worker_failed(worker, 503, "no KV room on gpu-node-7", redact)
    assert busy.status == 503 and busy.headers == {"Retry-After": "1"} and "gpu" not in json.dumps(busy.body())


def test_a_workers_4xx_keeps_its_field_indexes() -> None:
    """`messages[0]` is no bracketed IPv6 address: the worker's 400 once reached the client as
    'messages(internal).content: only text parts are supported', naming no field."""
    worker = Worker(Role.DECODE, "decode-0", "http://gpu-node-7:30001")
    redact = Redactor([worker.name], [worker.url], [])
    text = "messages[0].content: only text parts are supported; stop[12] and ids[ab] too"
    assert worker_failed(worker, 400, text, redact).body()["error"]["message"] == text
    assert redact.scrub("a [::1] and [fe80::1]:80 and [2001:db8::7]") == "a (internal) and (internal) and (internal)"


def test_a_workers_4xx_keeps_times_and_colon_text_of_the_request() -> None:
    """A worker's 400 echoing the client's text: a time (10:14:33) or a stop string ("a:b:c") read as bare IPv6 or
    host:port and reached the client as (internal); every address shape is still scrubbed."""
    redact = Redactor(["decode-0"], ["http://gpu-node-7:30001"], ["gpu-node-7"])
    text = 'stop: ["a:b:c"] at 10:14:33 and 12:30; cafe:beef is text too'
    assert redact.scrub(text) == text
    for address in ("fe80::1", "2001:db8::1", "::1", "2001:db8:0:0:0:0:0:1", "gpu-9:30001", "10.0.0.7:80"):
        assert redact.scrub(f"at {address} now") == "at (internal) now", address


def test_scrubbing_is_linear_in_what_a_worker_echoes_of_the_request() -> None:
    """A 4xx message may echo the client's input: 300 KB of it scrubbed in well under a second (the first regexes,
    a token pattern around the known names, took about 8 minutes on 150 KB of 'ab-')."""
    redact = Redactor(["decode-0"], ["http://gpu-node-7:30001"], ["gpu-node-7"])
    for echo in ("ab-" * 100_000, "a:" * 150_000, "a." * 150_000 + ":"):
        began = time.monotonic()
        redact.scrub(echo)
        assert time.monotonic() - began < 1.0


def test_a_bug_behind_any_other_route_is_a_500_envelope_without_the_exception(cluster: Cluster, monkeypatch) -> None:
    from dsv4_cluster.router import meta_api

    def boom(*_):
        raise RuntimeError("secret state at http://127.0.0.1:8998")
    monkeypatch.setattr(meta_api, "generate_latest", boom)
    resp = httpx.get(cluster.router.url + "/metrics", timeout=WAIT_S)
    assert resp.status_code == 500 and b"secret" not in resp.content and b"RuntimeError" not in resp.content
    assert "request id" in resp.json()["error"]["message"]


def test_a_pool_with_no_worker_coming_back_gets_503_without_retry_after_and_counts_workers_not_reasons() -> None:
    """A FAILED decode (crash loop) needs the operator's `restart`, but clients were told "retry later" with
    Retry-After: 1 and retried every second; and one worker both RESTARTING and failing health checks read
    "1 of 1 RESTARTING, 1 of 1 failing health checks", two of one."""
    settings = RouterSettings(model_name="m", prefill=[{"name": "p0", "url": "http://127.0.0.1:1000",
                                                        "bootstrap_host": "127.0.0.1"}],
                              decode=[{"name": f"d{i}", "url": f"http://127.0.0.1:{2000 + i}"} for i in range(2)])
    pool = WorkerPool(settings)
    (p0,), (d0, d1) = pool.prefill, pool.decode
    p0.state, p0.healthy = WorkerState.RESTARTING, False
    with pytest.raises(NoWorkers) as err:
        pool.pick()
    assert err.value.headers == {"Retry-After": "1"}
    assert err.value.body()["error"]["message"] == ("no prefill worker can take requests now (1 of 1 RESTARTING and "
                                                    "failing health checks); retry later")
    p0.state, p0.healthy = WorkerState.READY, True
    d0.state, d1.drained = WorkerState.FAILED, True
    with pytest.raises(NoWorkers) as err:
        pool.pick()
    assert err.value.status == 503 and err.value.headers is None
    assert err.value.body()["error"]["message"] == ("no decode worker can take requests now (1 of 2 FAILED, 1 of 2 "
                                                    "drained); none will until the operator brings one back")
    p0.state, p0.healthy = WorkerState.RESTARTING, False  # the prefill may come back, the decodes will not: said first
    with pytest.raises(NoWorkers) as err:
        pool.pick()
    assert err.value.headers is None and err.value.body()["error"]["message"].startswith("no decode worker"), err.value
    d1.state, d1.drained = WorkerState.STOPPED, False   # an operator's `restart`: stopped, then READY (nothing between)
    with pytest.raises(NoWorkers) as err:
        pool.pick()
    assert err.value.headers == {"Retry-After": "1"} and err.value.body()["error"]["message"].startswith(
        "no prefill worker") and err.value.body()["error"]["message"].endswith("retry later")   # both may: prefill
    p0.state, p0.healthy = WorkerState.READY, True
    with pytest.raises(NoWorkers) as err:
        pool.pick()
    assert err.value.headers == {"Retry-After": "1"} and err.value.body()["error"]["message"].endswith("retry later")
