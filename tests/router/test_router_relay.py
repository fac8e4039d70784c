"""The streaming relay (router/relay.py) against stub workers on real sockets (`bench/stubs.py`): what one
wake-up brings is framed once and written to the client in one ASGI send with one timing observation, and the
client's stream is cut on event boundaries however the decode's bytes were split."""

from __future__ import annotations

import re

import httpx

from bench.stubs import DECODE_STREAM
from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.settings import RouterSettings
from tests.servers import StubThread, UvicornThread, bound_socket

BODY = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}


def _events_of(http_stream: bytes) -> bytes:
    """The SSE bytes inside a chunked HTTP response (the stub's canned stream)."""
    body, out = http_stream[http_stream.index(b"\r\n\r\n") + 4:], b""
    while True:
        size_end = body.index(b"\r\n")
        size = int(body[:size_end], 16)
        if size == 0:
            return out
        out += body[size_end + 2:size_end + 2 + size]
        body = body[size_end + 2 + size + 2:]


STUB_EVENTS = _events_of(DECODE_STREAM)


def _stream_through_router(decode_fault: str | None) -> tuple[list[dict], bytes, str]:
    """One streamed chat completion through the router: the ASGI messages the router sent for it, the body the
    client read, and the router's /metrics text."""
    with StubThread("prefill", bound_socket()) as p, StubThread("decode", bound_socket(), decode_fault) as d:
        settings = RouterSettings(host="127.0.0.1", port=1, model_name="stub",
                                  prefill=[{"name": "p", "url": p.url, "bootstrap_host": "127.0.0.1"}],
                                  decode=[{"name": "d", "url": d.url}])
        app, sent = build_app(settings), []

        async def recording(scope, receive, send):
            async def record(message):
                if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
                    sent.append(message)
                await send(message)
            await app(scope, receive, record)

        with UvicornThread(recording) as router:
            resp = httpx.post(router.url + "/v1/chat/completions", json=BODY, timeout=10)
            metrics = httpx.get(router.url + "/metrics").text
    assert resp.status_code == 200
    return sent, resp.content, metrics


def _count(metrics: str, name: str) -> float:
    return float(re.search(rf"^{name}_count (\S+)$", metrics, re.M).group(1))


def test_a_stream_that_arrives_in_one_write_is_relayed_in_one_send_with_one_observation():
    sent, body, metrics = _stream_through_router(None)     # the stub writes its whole stream (10 events) at once
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert bodies[0]["body"] == STUB_EVENTS == body and bodies[0]["more_body"] is False
    assert _count(metrics, "dsv4_router_time_to_first_token_seconds") == 1
    assert _count(metrics, "dsv4_router_inter_token_latency_seconds") == 0


def test_a_stream_cut_anywhere_reaches_the_client_whole_on_event_boundaries():
    sent, body, metrics = _stream_through_router("trickle")   # 37-byte pieces 5 ms apart: events cut mid-way
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert body == STUB_EVENTS and b"".join(bodies) == STUB_EVENTS
    assert len(bodies) > 1 and all(b.endswith(b"\n\n") for b in bodies)    # each send ends on an event boundary
    observed = _count(metrics, "dsv4_router_time_to_first_token_seconds") + _count(
        metrics, "dsv4_router_inter_token_latency_seconds")
    assert observed == len(bodies)                                          # one timing observation per send


def test_a_response_head_leaves_in_one_write_with_its_first_body_piece():
    import asyncio

    from dsv4_cluster.router.server_protocol import HeadWithBody

    class Transport:                                   # records what reaches the socket, write by write
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, data):
            self.writes.append(data)

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

    async def scenario():
        loop = asyncio.get_running_loop()
        joined, alone, closing = Transport(), Transport(), Transport()
        conn = HeadWithBody(joined, loop)
        conn.write(b"HEAD")
        conn.write(b"body")
        conn.write(b"more")
        lone = HeadWithBody(alone, loop)
        lone.write(b"HEAD")                            # a head with no body this loop turn
        early = HeadWithBody(closing, loop)
        early.write(b"HEAD")
        early.close()
        await asyncio.sleep(0)
        return joined.writes, alone.writes, closing.writes, closing.closed

    joined, alone, closing, closed = asyncio.run(scenario())
    assert joined == [b"HEADbody", b"more"] and alone == [b"HEAD"] and closing == [b"HEAD"] and closed
