"""Fake prefill/decode servers for router tests, on real loopback ports.

The fakes behave like SGLang's PD pair where the router can tell: the prefill answers only after the
decode leg of the same rid arrived (so a router that posts prefill first times out here), the decode
answers after the prefill "sent" its KV, both record every body and every `/abort_request`, and both
answer `/health` (503 in mode "unhealthy").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.sse import DONE
from tests.helpers import SOON_S, TimedOut, wait_for, wait_for_async
from tests.servers import UvicornThread

WAIT_S = 5.0


@dataclass
class Rendezvous:
    """Per-rid meeting point of the two legs, shared by the fake servers' threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    events: dict[str, threading.Event] = field(default_factory=dict)

    def __call__(self, what: str, rid: Any) -> threading.Event:
        with self.lock:
            return self.events.setdefault(what + json.dumps(rid), threading.Event())


# what the embedded decode streams when the prefill's bootstrap server is gone: internal URL, host, agent name
LEAKY = {"error": {"message": "KV bootstrap failed: prefill bootstrap http://gpu-node-7:8998 unreachable: "
                              "ConnectError; agent decode-gpu-node-7-30001", "type": "internal", "code": 500}}
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
    hold_s: float = 3.0  # mode "hold": how long the prefill keeps the KV (unless its leg is aborted first); a
    # "head_first" decode waits for the KV at least this long (else WAIT_S); an "answer_late" decode answers this
    # long after the KV arrived
    tokens: int = 100  # how many tokens a "slow" decode streams (0.05 s apart)

    def reset(self, mode: str) -> None:
        self.mode, self.received, self.aborted = mode, [], []

    def aborted_soon(self, rid: str | None = None) -> bool:
        """True once `rid` (None: any rid) is aborted; an AssertionError after SOON_S."""
        return wait_for(lambda: rid in self.aborted if rid else bool(self.aborted), SOON_S,
                        f"{self.role} to be aborted ({rid or 'any rid'})")

    async def wait(self, what: str, rid: Any, timeout_s: float = WAIT_S) -> bool:
        """Wait for the other leg's `what` unless this leg gets aborted."""
        event = self.meet(what, rid)
        with contextlib.suppress(TimedOut):
            await wait_for_async(lambda: event.is_set() or json.dumps(rid) in self.ever_aborted, timeout_s,
                                 f"{what} of {rid}", interval_s=0.005)
        return event.is_set()

    async def prefill(self, body: dict, rid: Any, stream: bool) -> Any:
        mode = self.mode  # as the request arrived: a test that flips the mode mid-request changes the next ones
        self.meet("prefill_arrived", rid).set()
        if not await self.wait("decode_arrived", rid):
            return JSONResponse({"error": {"message": "decode leg never arrived"}}, status_code=500)
        if mode == "fail":
            return JSONResponse({"object": "error", "message": "KV transfer failed", "code": 500}, status_code=500)
        if mode in ("hold", "fail_later"):
            await asyncio.sleep(0.3)
        if mode == "fail_later":
            err = {"error": {"message": "KV transfer failed", "type": "internal", "code": 500}}
            return StreamingResponse(iter([event(err), DONE]), media_type=SSE) if stream else JSONResponse(err, 500)
        if mode == "hold":
            await self.wait("never", rid, timeout_s=self.hold_s)
        if stream and mode == "die_once":   # a killed process: the stream's head went out, then the connection drops
            self.mode = "ok"                # mid-prefill (no KV); the next request is served as usual
            return StreamingResponse(self._dropped(asyncio.sleep(0.2), rid), media_type=SSE)
        self.meet("kv_sent", rid).set()
        if stream and mode == "drop_after_kv":   # the KV went out; the process dies before its answer ended, when
            return StreamingResponse(self._dropped(self.wait("drop", rid, self.hold_s), rid), media_type=SSE)  # told
        finish = {"type": "length", "length": 0}
        if stream:
            return StreamingResponse(iter([answer("prefill", "x", finish), DONE]), media_type=SSE)
        return answer("prefill", "x", finish, stream=False)

    async def decode(self, body: dict, rid: Any, stream: bool) -> Any:
        mode = self.mode  # as the request arrived, as in prefill()
        if stream and mode == "error_first_once":  # the next streamed request takes it; later ones stream as usual
            self.mode = "ok"
        self.meet("decode_arrived", rid).set()
        if mode == "fail":
            return JSONResponse({"object": "error", "message": "no KV room", "code": 503}, status_code=503)
        if mode == "head_first":   # the status line now (as SGLang's decode), the answer once the KV came

            async def body() -> Any:
                if await self.wait("kv_sent", rid, timeout_s=max(WAIT_S, self.hold_s)):
                    if stream:
                        yield answer("decode", "tok0 ") + answer("decode", None, "stop") + DONE
                    else:
                        yield json.dumps(answer("decode", "hello world", "stop", stream=False))

            return StreamingResponse(body(), media_type=SSE if stream else "application/json")
        slow = mode == "slow" and stream  # streams while P still works, as P's failure tests need
        if not await self.wait("prefill_arrived" if slow else "kv_sent", rid):
            return JSONResponse({"error": {"message": "prefill never sent KV"}}, status_code=500)
        if not stream:
            if mode == "answer_late":
                await self.wait("never", rid, timeout_s=self.hold_s)
            return answer("decode", "hello world", "stop", stream=False)

        if mode.startswith("error_first"):
            return StreamingResponse(iter([event(LEAKY), DONE]), media_type=SSE)

        async def tokens() -> Any:
            for i in range(self.tokens if slow else 2):
                if rid in self.aborted:
                    break
                yield answer("decode", f"tok{i} ")
                await asyncio.sleep(0.05 if slow else 0)
            if mode == "error_mid":
                yield event(LEAKY)
                yield DONE
                return
            yield answer("decode", None, "abort" if rid in self.aborted else "stop")
            yield DONE

        return StreamingResponse(tokens(), media_type=SSE)

    async def _dropped(self, until: Any, rid: Any) -> Any:
        """A stream body that ends, once `until` is done, with its connection dropped (uvicorn closes it on the
        error); "dropped" is met then."""
        await until
        self.meet("dropped", rid).set()
        raise ConnectionAbortedError("the worker died")
        yield b""  # a generator

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Any:
            body = await request.json()
            self.received.append({"path": request.url.path, "body": body})
            serve = self.prefill if self.role == "prefill" else self.decode
            return await serve(body, body.get("rid"), bool(body.get("stream")))

        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.add_api_route(path, generate, methods=["POST"])

        @app.get("/health")
        async def health() -> Any:
            return JSONResponse({}, status_code=503 if self.mode == "unhealthy" else 200)

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


def router_settings(prefill_url: str, *decode_urls: str, **extra: Any) -> RouterSettings:
    extra = {"request_timeout_s": 10, "connect_timeout_s": 2, "context_length": 2048, **extra}
    return RouterSettings(
        host="127.0.0.1", port=1, model_name="dsv4-tiny",
        prefill=[{"name": "prefill-0", "url": prefill_url, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}],
        decode=[{"name": f"decode-{i}", "url": url} for i, url in enumerate(decode_urls)], **extra)


MESSAGES = [{"role": "user", "content": "hi"}]


def chat(url: str, stream: bool = False, timeout: float = WAIT_S, **headers: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "stream": stream}, timeout=timeout,
                      headers=headers)
