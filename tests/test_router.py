"""The router against fake prefill/decode servers on real loopback ports.

The fakes behave like SGLang's PD pair where the router can tell: the prefill answers only after the
decode leg of the same rid arrived (so a router that posts prefill first times out here), the decode
answers after the prefill "sent" its KV, both record every body and every `/abort_request`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsv4_cluster.router.__main__ import main as router_main
from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.pairing import ROOM_LIMIT
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.sse import events
from dsv4_cluster.tests.servers import UvicornThread, free_port

WAIT_S = 5.0


@dataclass
class Rendezvous:
    """Per-rid meeting point of the two legs, shared by the fake servers' threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    decode_arrived: dict[str, threading.Event] = field(default_factory=dict)
    kv_sent: dict[str, threading.Event] = field(default_factory=dict)

    def get(self, table: dict[str, threading.Event], rid: Any) -> threading.Event:
        with self.lock:
            return table.setdefault(json.dumps(rid), threading.Event())


async def wait_event(event: threading.Event, stop: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    """Wait for `event` (set by the other leg's thread) unless `stop()` (this leg was aborted)."""
    deadline = time.monotonic() + timeout_s
    while not event.is_set() and not stop() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return event.is_set()


def chunk(text: str | None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def completion(text: str, finish: Any = "stop") -> dict:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@dataclass
class FakeWorker:
    """One fake SGLang server of `role`; `mode` picks its behaviour for the next requests."""

    role: str
    meet: Rendezvous
    mode: str = "ok"
    received: list[dict] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def reset(self, mode: str = "ok") -> None:
        self.mode, self.received, self.aborted = mode, [], []

    def aborted_soon(self, rid: str | None = None) -> bool:
        """Whether `rid` (None: any rid) is aborted within WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not self._aborted(rid) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._aborted(rid)

    def _aborted(self, rid: str | None) -> bool:
        return rid in self.aborted if rid is not None else bool(self.aborted)

    async def _prefill(self, body: dict) -> Any:
        rid = body.get("rid")
        if not await wait_event(self.meet.get(self.meet.decode_arrived, rid), lambda: rid in self.aborted):
            return JSONResponse({"error": {"message": "decode leg never arrived"}}, status_code=500)
        if self.mode == "fail":
            return JSONResponse({"object": "error", "message": "KV transfer failed", "code": 500}, status_code=500)
        if self.mode in ("hold", "fail_later"):
            await asyncio.sleep(0.3)
            if self.mode == "fail_later":
                err = {"error": {"message": "KV transfer failed", "type": "internal", "code": 500}}
                if body.get("stream"):
                    return StreamingResponse(iter([b"data: " + json.dumps(err).encode() + b"\n\n", b"data: [DONE]\n\n"]),
                                             media_type="text/event-stream")
                return JSONResponse(err, status_code=500)
            await wait_event(threading.Event(), lambda: rid in self.aborted, timeout_s=3.0)
        self.meet.get(self.meet.kv_sent, body.get("rid")).set()
        if body.get("stream"):
            return StreamingResponse(iter([chunk("x", "length"), b"data: [DONE]\n\n"]), media_type="text/event-stream")
        return completion("x", {"type": "length", "length": 0})

    async def _decode(self, body: dict) -> Any:
        self.meet.get(self.meet.decode_arrived, body.get("rid")).set()
        if self.mode == "fail":
            return JSONResponse({"object": "error", "message": "no KV room", "code": 503}, status_code=503)
        slow = self.mode == "slow" and body.get("stream")
        rid = body.get("rid")
        if not slow and not await wait_event(self.meet.get(self.meet.kv_sent, rid), lambda: rid in self.aborted):
            return JSONResponse({"error": {"message": "prefill never sent KV"}}, status_code=500)
        if not body.get("stream"):
            return completion("hello world")

        async def stream() -> Any:
            for i in range(100 if slow else 2):
                if body.get("rid") in self.aborted:
                    yield chunk(None, "abort")
                    break
                yield chunk(f"tok{i} ")
                await asyncio.sleep(0.05 if slow else 0)
            yield chunk(None, "stop")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Any:
            body = await request.json()
            self.received.append({"path": request.url.path, "body": body})
            return await (self._prefill(body) if self.role == "prefill" else self._decode(body))

        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.add_api_route(path, generate, methods=["POST"])

        @app.post("/abort_request")
        async def abort(request: Request) -> dict:
            self.aborted.append((await request.json())["rid"])
            return {}

        return app


@dataclass
class Cluster:
    prefill: FakeWorker
    decode: FakeWorker
    router: UvicornThread
    settings: RouterSettings

    def reset(self, prefill: str = "ok", decode: str = "ok") -> None:
        self.prefill.reset(prefill)
        self.decode.reset(decode)

    def legs(self) -> tuple[dict, dict]:
        assert len(self.prefill.received) == 1 and len(self.decode.received) == 1
        return self.prefill.received[0], self.decode.received[0]


def router_settings(prefill_url: str, decode_url: str, **extra: Any) -> RouterSettings:
    return RouterSettings(
        host="127.0.0.1", port=1, model_name="dsv4-tiny", request_timeout_s=10, connect_timeout_s=2,
        prefill=[{"name": "prefill-0", "url": prefill_url, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}],
        decode=[{"name": "decode-0", "url": decode_url}], **extra)


@pytest.fixture(scope="module")
def cluster():
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet)
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url)
        with UvicornThread(build_app(settings)) as router:
            yield Cluster(prefill, decode, router, settings)


@pytest.fixture
def fresh(cluster: Cluster) -> Callable[..., Cluster]:
    def make(prefill: str = "ok", decode: str = "ok") -> Cluster:
        cluster.reset(prefill, decode)
        return cluster
    return make


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S * 2)


MESSAGES = [{"role": "user", "content": "hi"}]


def assert_paired(cluster: Cluster, path: str) -> dict:
    p, d = cluster.legs()
    assert p["path"] == d["path"] == path
    assert p["body"] == d["body"], "both legs get the same body"
    body = p["body"]
    assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 8998
    assert isinstance(body["rid"], str) and len(body["rid"]) == 32
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < ROOM_LIMIT
    return body


def test_chat_plain_through_openai_client(fresh) -> None:
    cluster = fresh()
    reply = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=4)
    assert reply.choices[0].message.content == "hello world"
    body = assert_paired(cluster, "/v1/chat/completions")
    assert body["messages"] == MESSAGES and body["max_tokens"] == 4


def test_each_request_gets_its_own_room_and_rid(fresh) -> None:
    cluster = fresh()
    seen = set()
    for _ in range(3):
        cluster.reset()
        client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES)
        body = assert_paired(cluster, "/v1/chat/completions")
        seen.add((body["rid"], body["bootstrap_room"]))
    assert len({rid for rid, _ in seen}) == 3 and len({room for _, room in seen}) == 3


def test_chat_stream_through_openai_client(fresh) -> None:
    cluster = fresh()
    stream = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "tok0 tok1 "
    assert assert_paired(cluster, "/v1/chat/completions")["stream"] is True


def test_stream_passthrough_ends_with_done(fresh) -> None:
    cluster = fresh()
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "stream": True}, timeout=WAIT_S) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n")
    assert raw.count(b"data: ") == 4, "two tokens, the stop chunk and [DONE], nothing added"


def test_completions_and_generate_are_paired(fresh) -> None:
    cluster = fresh()
    reply = client(cluster).completions.create(model="dsv4-tiny", prompt="hi", max_tokens=2)
    assert reply.choices[0] is not None
    assert_paired(cluster, "/v1/completions")
    cluster.reset()
    resp = httpx.post(cluster.router.url + "/generate", json={"text": "hi", "sampling_params": {}})
    assert resp.status_code == 200
    assert_paired(cluster, "/generate")


def test_batched_generate_carries_one_entry_per_item(fresh) -> None:
    cluster = fresh()
    resp = httpx.post(cluster.router.url + "/generate", json={"text": ["a", "b", "c"]})
    assert resp.status_code == 200
    p, d = cluster.legs()
    body = p["body"]
    assert body == d["body"]
    assert body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert len(set(body["bootstrap_room"])) == 3 and all(0 <= r < ROOM_LIMIT for r in body["bootstrap_room"])
    assert len(set(body["rid"])) == 3


def test_prefill_failure_returns_its_error_and_aborts_decode(fresh) -> None:
    cluster = fresh(prefill="fail", decode="slow")
    resp = httpx.post(cluster.router.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=WAIT_S)
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert "prefill worker 'prefill-0'" in error["message"] and "KV transfer failed" in error["message"]
    assert cluster.decode.aborted_soon(cluster.legs()[1]["body"]["rid"])


def test_prefill_failure_mid_stream_ends_stream_with_error(fresh) -> None:
    cluster = fresh(prefill="fail_later", decode="slow")
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "stream": True}, timeout=WAIT_S) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[0].startswith("data: ") and "tok0" in lines[0]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "prefill worker 'prefill-0'" in error["message"]
    assert cluster.decode.aborted_soon(cluster.legs()[1]["body"]["rid"])


def test_decode_error_is_passed_through_and_prefill_aborted(fresh) -> None:
    cluster = fresh(prefill="hold", decode="fail")
    resp = httpx.post(cluster.router.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=WAIT_S)
    assert resp.status_code == 503 and resp.json()["message"] == "no KV room"
    assert cluster.prefill.aborted_soon(cluster.legs()[0]["body"]["rid"])


def test_client_disconnect_mid_stream_aborts_both_legs(fresh) -> None:
    cluster = fresh(prefill="hold", decode="slow")
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "stream": True}, timeout=WAIT_S) as resp:
        first = next(resp.iter_lines())
        assert "tok0" in first
    rid = cluster.legs()[0]["body"]["rid"]
    assert cluster.decode.aborted_soon(rid) and cluster.prefill.aborted_soon(rid)


def test_client_disconnect_while_waiting_aborts_both_legs(fresh) -> None:
    cluster = fresh(prefill="hold", decode="ok")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.router.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=0.2)
    time.sleep(0.05)
    rid = cluster.legs()[0]["body"]["rid"]
    assert cluster.decode.aborted_soon(rid) and cluster.prefill.aborted_soon(rid)


def test_models_and_health(cluster: Cluster) -> None:
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == ["dsv4-tiny"] and models.data[0].owned_by == "dsv4-cluster"
    health = httpx.get(cluster.router.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["prefill"] == ["prefill-0"] and health.json()["decode"] == ["decode-0"]


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"model": "m"}', "'messages'"),
    (b'{"messages": [], "rid": "mine"}', "the router sets ['rid']"),
    (b'{"messages": [], "stream": "yes"}', "'stream' must be true or false"),
])
def test_bad_requests_get_400(cluster: Cluster, content: bytes, needle: str) -> None:
    cluster.reset()
    resp = httpx.post(cluster.router.url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
    assert cluster.prefill.received == [] and cluster.decode.received == []


def test_unreachable_decode_names_worker_and_url_and_aborts_prefill(cluster: Cluster) -> None:
    cluster.reset(prefill="hold")
    dead = f"http://127.0.0.1:{free_port()}"
    settings = router_settings(cluster.settings.prefill[0].url, dead)
    with UvicornThread(build_app(settings)) as router:
        for stream in (False, True):
            cluster.reset(prefill="hold")
            resp = httpx.post(router.url + "/v1/chat/completions", json={"messages": MESSAGES, "stream": stream},
                              timeout=WAIT_S)
            assert resp.status_code == 502
            message = resp.json()["error"]["message"]
            assert "decode worker 'decode-0'" in message and dead in message
            assert cluster.prefill.aborted_soon()  # its request may be cancelled before it was sent
            if cluster.prefill.received:
                assert cluster.prefill.received[0]["body"]["rid"] in cluster.prefill.aborted


def test_router_without_workers_is_unhealthy_and_refuses() -> None:
    with UvicornThread(build_app(RouterSettings(model_name="m"))) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        resp = httpx.post(router.url + "/v1/chat/completions", json={"messages": MESSAGES})
        assert resp.status_code == 503 and "no prefill worker" in resp.json()["error"]["message"]


def test_sse_events_are_reframed_across_chunk_boundaries() -> None:
    async def chunks():
        for piece in (b"data: {\"a\"", b": 1}\r\n", b"\r\ndata: [DO", b"NE]\n\n"):
            yield piece

    async def collect() -> list[bytes]:
        return [e async for e in events(chunks())]

    assert asyncio.run(collect()) == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]


def test_cli_rejects_bad_settings_with_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model_name": "m", "decode": [{"name": "d", "url": "localhost:1"}], "prot": 1}))
    assert router_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "decode.0.url" in err and "prot" in err
    assert router_main(["--config", str(tmp_path / "missing.json")]) == 2


def test_cli_serves_the_settings_file(cluster: Cluster, tmp_path) -> None:
    port = free_port("127.0.0.1")
    path = tmp_path / "router.json"
    path.write_text(cluster.settings.model_copy(update={"port": 1}).model_dump_json())
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.router", "--config", str(path),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "router did not come up"
                time.sleep(0.1)
        cluster.reset()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": MESSAGES})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hello world"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert f"serving on http://127.0.0.1:{port}" in out
