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
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsv4_cluster.router.__main__ import main as router_main
from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.pairing import ROOM_LIMIT
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.sse import DONE, events
from dsv4_cluster.tests.servers import UvicornThread, free_port

WAIT_S = 5.0


@dataclass
class Rendezvous:
    """Per-rid meeting point of the two legs, shared by the fake servers' threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    events: dict[str, threading.Event] = field(default_factory=dict)

    def __call__(self, what: str, rid: Any) -> threading.Event:
        with self.lock:
            return self.events.setdefault(what + json.dumps(rid), threading.Event())


LOGPROBS = {"prefill": [[-0.5, 7, None]], "decode": [[-0.1, 8, None]]}  # meta_info.input_token_logprobs
SSE = "text/event-stream"


def event(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def answer(role: str, text: str | None, finish: Any = None, stream: bool = True) -> Any:
    """A chat completion (or chunk) carrying `role`'s input logprobs the way SGLang's `/generate` does."""
    key, obj = ("delta", "chat.completion.chunk") if stream else ("message", "chat.completion")
    choice = {"index": 0, key: {} if text is None else {"role": "assistant", "content": text}, "finish_reason": finish}
    body = {"id": "c", "object": obj, "created": 0, "model": "m", "choices": [choice],
            "meta_info": {"input_token_logprobs": LOGPROBS[role]}}
    return event(body) if stream else body


@dataclass
class FakeWorker:
    """One fake SGLang server of `role`; `mode` picks its behaviour for the next requests."""

    role: str
    meet: Rendezvous
    mode: str = "ok"
    received: list[dict] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    ever_aborted: set[str] = field(default_factory=set)  # what reset() does not clear: late legs still stop

    def reset(self, mode: str) -> None:
        self.mode, self.received, self.aborted = mode, [], []

    def aborted_soon(self, rid: str | None = None) -> bool:
        """Whether `rid` (None: any rid) is aborted within WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not (rid in self.aborted if rid else self.aborted) and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(rid in self.aborted if rid else self.aborted)

    async def wait(self, what: str, rid: Any, timeout_s: float = WAIT_S) -> bool:
        """Wait for the other leg's `what` unless this leg gets aborted."""
        event, deadline = self.meet(what, rid), time.monotonic() + timeout_s
        while not event.is_set() and json.dumps(rid) not in self.ever_aborted:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        return event.is_set()

    async def prefill(self, body: dict, rid: Any, stream: bool) -> Any:
        self.meet("prefill_arrived", rid).set()
        if not await self.wait("decode_arrived", rid):
            return JSONResponse({"error": {"message": "decode leg never arrived"}}, status_code=500)
        if self.mode == "fail":
            return JSONResponse({"object": "error", "message": "KV transfer failed", "code": 500}, status_code=500)
        if self.mode in ("hold", "fail_later"):
            await asyncio.sleep(0.3)
        if self.mode == "fail_later":
            err = {"error": {"message": "KV transfer failed", "type": "internal", "code": 500}}
            return StreamingResponse(iter([event(err), DONE]), media_type=SSE) if stream else JSONResponse(err, 500)
        if self.mode == "hold":
            await self.wait("never", rid, timeout_s=3.0)
        self.meet("kv_sent", rid).set()
        finish = {"type": "length", "length": 0}
        if stream:
            return StreamingResponse(iter([answer("prefill", "x", finish), DONE]), media_type=SSE)
        return answer("prefill", "x", finish, stream=False)

    async def decode(self, body: dict, rid: Any, stream: bool) -> Any:
        self.meet("decode_arrived", rid).set()
        if self.mode == "fail":
            return JSONResponse({"object": "error", "message": "no KV room", "code": 503}, status_code=503)
        slow = self.mode == "slow" and stream  # streams while P still works, as P's failure tests need
        if not await self.wait("prefill_arrived" if slow else "kv_sent", rid):
            return JSONResponse({"error": {"message": "prefill never sent KV"}}, status_code=500)
        if not stream:
            return answer("decode", "hello world", "stop", stream=False)

        async def tokens() -> Any:
            for i in range(100 if slow else 2):
                if rid in self.aborted:
                    break
                yield answer("decode", f"tok{i} ")
                await asyncio.sleep(0.05 if slow else 0)
            yield answer("decode", None, "abort" if rid in self.aborted else "stop")
            yield DONE

        return StreamingResponse(tokens(), media_type=SSE)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Any:
            body = await request.json()
            self.received.append({"path": request.url.path, "body": body})
            serve = self.prefill if self.role == "prefill" else self.decode
            return await serve(body, body.get("rid"), bool(body.get("stream")))

        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.add_api_route(path, generate, methods=["POST"])

        @app.post("/abort_request")
        async def abort(request: Request) -> dict:
            rid = (await request.json())["rid"]
            self.aborted.append(rid)
            self.ever_aborted.add(json.dumps(rid))
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


def router_settings(prefill_url: str, decode_url: str) -> RouterSettings:
    return RouterSettings(
        host="127.0.0.1", port=1, model_name="dsv4-tiny", request_timeout_s=10, connect_timeout_s=2,
        prefill=[{"name": "prefill-0", "url": prefill_url, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}],
        decode=[{"name": "decode-0", "url": decode_url}])


@pytest.fixture(scope="module")
def cluster():
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet)
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url)
        with UvicornThread(build_app(settings)) as router:
            yield Cluster(prefill, decode, router, settings)


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S * 2)


MESSAGES = [{"role": "user", "content": "hi"}]


def chat(url: str, stream: bool = False, timeout: float = WAIT_S) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "stream": stream}, timeout=timeout)


def stream_lines(url: str, path: str = "/v1/chat/completions", **body: Any) -> list[str]:
    with httpx.stream("POST", url + path, json={"messages": MESSAGES, **body, "stream": True}, timeout=WAIT_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(SSE)
        return [line.removeprefix("data: ") for line in r.iter_lines() if line]


def assert_paired(cluster: Cluster, path: str) -> dict:
    p, d = cluster.legs()
    assert p["path"] == d["path"] == path
    assert p["body"] == d["body"], "both legs get the same body"
    body = p["body"]
    assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 8998
    assert isinstance(body["rid"], str) and len(body["rid"]) == 32
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < ROOM_LIMIT
    return body


def test_chat_plain_through_openai_client(cluster: Cluster) -> None:
    seen = set()
    for _ in range(3):
        cluster.reset()
        reply = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=4)
        assert reply.choices[0].message.content == "hello world"
        body = assert_paired(cluster, "/v1/chat/completions")
        assert body["messages"] == MESSAGES and body["max_tokens"] == 4
        seen.add((body["rid"], body["bootstrap_room"]))
    assert len({rid for rid, _ in seen}) == 3 and len({room for _, room in seen}) == 3, "fresh rid and room"


def test_chat_stream_through_openai_client_and_raw(cluster: Cluster) -> None:
    cluster.reset()
    stream = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "tok0 tok1 "
    assert assert_paired(cluster, "/v1/chat/completions")["stream"] is True
    cluster.reset()
    data = stream_lines(cluster.router.url)
    assert data[-1] == "[DONE]" and len(data) == 4, "two tokens, the stop chunk and [DONE], nothing added"


def test_completions_and_generate_are_paired(cluster: Cluster) -> None:
    cluster.reset()
    assert client(cluster).completions.create(model="dsv4-tiny", prompt="hi", max_tokens=2).choices
    assert_paired(cluster, "/v1/completions")
    cluster.reset()
    assert httpx.post(cluster.router.url + "/generate", json={"text": "hi", "sampling_params": {}}).status_code == 200
    assert_paired(cluster, "/generate")
    cluster.reset()
    assert httpx.post(cluster.router.url + "/generate", json={"text": ["a", "b", "c"]}).status_code == 200
    body, decode = (leg["body"] for leg in cluster.legs())
    assert body == decode and body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert len(set(body["bootstrap_room"])) == 3 and all(0 <= r < ROOM_LIMIT for r in body["bootstrap_room"])
    assert len(set(body["rid"])) == 3, "a batch carries one rid and one room per item"


def test_generate_logprobs_put_prefill_first(cluster: Cluster) -> None:
    cluster.reset()
    want = LOGPROBS["prefill"] + LOGPROBS["decode"]
    body = {"text": "hi", "return_logprob": True}
    resp = httpx.post(cluster.router.url + "/generate", json=body, timeout=WAIT_S)
    assert resp.json()["meta_info"]["input_token_logprobs"] == want
    cluster.reset()
    data = stream_lines(cluster.router.url, "/generate", **body)
    assert data[-1] == "[DONE]" and len(data) == 4
    assert all(json.loads(d)["meta_info"]["input_token_logprobs"] == want for d in data[:-1])


def test_prefill_failure_returns_its_error_and_aborts_decode(cluster: Cluster) -> None:
    cluster.reset(prefill="fail", decode="slow")
    resp = chat(cluster.router.url)
    message = resp.json()["error"]["message"]
    assert resp.status_code == 500 and "prefill worker 'prefill-0'" in message and "KV transfer failed" in message
    assert cluster.decode.aborted_soon(cluster.legs()[1]["body"]["rid"])


def test_prefill_failure_mid_stream_ends_stream_with_error(cluster: Cluster) -> None:
    cluster.reset(prefill="fail_later", decode="slow")
    data = stream_lines(cluster.router.url)
    assert "tok0" in data[0] and data[-1] == "[DONE]"
    assert "prefill worker 'prefill-0'" in json.loads(data[-2])["error"]["message"]
    assert cluster.decode.aborted_soon(cluster.legs()[1]["body"]["rid"])


def test_decode_error_is_passed_through_and_prefill_aborted(cluster: Cluster) -> None:
    cluster.reset(prefill="hold", decode="fail")
    assert (resp := chat(cluster.router.url)).status_code == 503 and resp.json()["message"] == "no KV room"
    assert cluster.prefill.aborted_soon(cluster.legs()[0]["body"]["rid"])


def test_client_disconnect_mid_stream_aborts_both_legs(cluster: Cluster) -> None:
    cluster.reset(prefill="hold", decode="slow")
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "stream": True}, timeout=WAIT_S) as resp:
        assert "tok0" in next(resp.iter_lines())
    rid = cluster.legs()[0]["body"]["rid"]
    assert cluster.decode.aborted_soon(rid) and cluster.prefill.aborted_soon(rid)


def test_client_disconnect_while_waiting_aborts_both_legs(cluster: Cluster) -> None:
    cluster.reset(prefill="hold", decode="ok")
    with pytest.raises(httpx.ReadTimeout):
        chat(cluster.router.url, timeout=0.2)
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


@pytest.mark.parametrize("dead, status, needle", [
    (True, 502, "cannot connect to decode worker 'decode-0' at {decode}"),
    (False, 504, "did not answer within 0.5 s (request_timeout_s)"),  # P holds, so D waits for KV
])
def test_dead_or_slow_worker_gives_502_or_504_and_aborts_the_legs(cluster: Cluster, dead, status, needle) -> None:
    decode = f"http://127.0.0.1:{free_port()}" if dead else cluster.settings.decode[0].url
    settings = router_settings(cluster.settings.prefill[0].url, decode).model_copy(update={"request_timeout_s": 0.5})
    with UvicornThread(build_app(settings)) as router:
        for stream in (False, True):
            cluster.reset(prefill="hold")
            resp = chat(router.url, stream=stream)
            assert resp.status_code == status and needle.format(decode=decode) in resp.json()["error"]["message"]
            assert cluster.prefill.aborted_soon()  # its request may be cancelled before it was sent
            assert all(leg["body"]["rid"] in cluster.prefill.aborted for leg in cluster.prefill.received)
            assert dead or cluster.decode.aborted_soon(cluster.decode.received[0]["body"]["rid"])


def test_router_without_workers_is_unhealthy_and_refuses() -> None:
    with UvicornThread(build_app(RouterSettings(model_name="m"))) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        resp = chat(router.url)
        assert resp.status_code == 503 and "no prefill worker" in resp.json()["error"]["message"]


def test_sse_events_are_reframed_across_chunk_boundaries() -> None:
    async def collect(*pieces: bytes) -> list[bytes]:
        return [e async for e in events(aiter_of(pieces))]

    async def aiter_of(pieces: tuple[bytes, ...]) -> Any:
        for piece in pieces:
            yield piece

    got = asyncio.run(collect(b'data: {"a"', b": 1}\r", b"\n\r\ndata: [DO", b"NE]\n\n"))
    assert got == [b'data: {"a": 1}\n\n', DONE]


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
                pass  # not listening yet
            assert proc.poll() is None and time.monotonic() < deadline, "router did not come up"
            time.sleep(0.1)
        cluster.reset()
        resp = chat(f"http://127.0.0.1:{port}")
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hello world"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert f"serving on http://127.0.0.1:{port}" in out
