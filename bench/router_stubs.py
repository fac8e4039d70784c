"""Stub prefill/decode servers for the router benchmark: the PD protocol's shape, no compute.

`python -m bench.router_stubs --role prefill|decode --port P` serves, over HTTP/1.1 keep-alive,
what a router needs from SGLang's PD workers (docs/protocol.md): the generation paths answer at once (prefill:
one token and `finish_reason` length 0; decode: `TOKENS` content chunks, a stop chunk and `data: [DONE]`,
chunked like SGLang's streams), plus `/health`, `/abort_request`, `/v1/models`, `/model_info`,
`/server_info`. Every answer is one write on a TCP_NODELAY socket. It is a raw asyncio protocol so that the stub, not the router under test, is never the
bottleneck. `GET /stats` returns how many generation requests it received and how many carried PD bootstrap
fields, so the benchmark can check that a router really paired every request.

`fault` makes the stub misbehave on generation requests, for the router's fault tests: `close` reads the
request and closes the connection without a byte of answer (a worker dying before it answered);
`close_reused` answers the first request of each connection and closes on the second without answering
(a keep-alive connection closed just as a request went out on it); `break` sends the status line and two
events, then closes (a decode dying mid-stream); `reject` answers 400; `headers_first` sends a stream's status
line at once and its events 0.3 s later (as SGLang's decode does while it waits for the KV); `trickle` writes a
stream in `TRICKLE_BYTES`-byte pieces 5 ms apart, cutting events (and chunk headers) anywhere. `StubThread` serves
one in a thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading

TOKENS = 8
GENERATION_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/generate")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _choice(delta: dict, finish: object) -> dict:
    return {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _sse_response(events: list[bytes]) -> bytes:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    return head + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"


def _json_response(body: object, status: bytes = b"200 OK") -> bytes:
    data = json.dumps(body).encode()
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(data), data)


DECODE_STREAM = _sse_response(
    [_event(_choice({"role": "assistant", "content": f"t{i} "}, None)) for i in range(TOKENS)]
    + [_event(_choice({}, "stop")), b"data: [DONE]\n\n"])
PREFILL_STREAM = _sse_response([_event(_choice({"role": "assistant", "content": "t"},
                                               {"type": "length", "length": 0})), b"data: [DONE]\n\n"])
DECODE_JSON = _json_response({"id": "stub", "object": "chat.completion", "created": 0, "model": "stub",
                              "choices": [{"index": 0, "message": {"role": "assistant",
                                                                   "content": "".join(f"t{i} " for i in range(TOKENS))},
                                           "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 4, "completion_tokens": TOKENS, "total_tokens": 4 + TOKENS}})
PREFILL_JSON = _json_response({"id": "stub", "object": "chat.completion", "created": 0, "model": "stub",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "t"},
                                            "finish_reason": {"type": "length", "length": 0}}]})


BROKEN_STREAM = DECODE_STREAM[:DECODE_STREAM.index(b"\r\n\r\n") + 4] + b"".join(
    _chunk(_event(_choice({"role": "assistant", "content": f"t{i} "}, None))) for i in range(2))
REJECT = _json_response({"error": {"message": "bad field", "type": "invalid_request_error", "code": 400}},
                        b"400 Bad Request")
FAULTS = ("close", "close_reused", "break", "reject", "headers_first", "trickle")
TRICKLE_BYTES = 37
STREAM_HEAD_END = DECODE_STREAM.index(b"\r\n\r\n") + 4


class Stats:
    def __init__(self) -> None:
        self.generations = 0
        self.paired = 0
        self.token_usage = 0.0  # what `/metrics` reports as `sglang:token_usage`


class StubProtocol(asyncio.Protocol):
    """One keep-alive connection: parse requests (Content-Length bodies), answer each at once."""

    def __init__(self, role: str, port: int, stats: Stats, fault: str | None = None) -> None:
        self.role, self.port, self.stats, self.fault = role, port, stats, fault
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.served = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it already; said here because the benchmark relies on it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"content-length:")
            if at >= 0:
                length = int(lower[at + 15: lower.find(b"\r\n", at) if lower.find(b"\r\n", at) > 0 else None])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4: end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            if head.startswith(b"PRI * HTTP/2.0"):  # the Rust router tries HTTP/2 first; refuse, it falls back
                self.transport.close()
                return
            method, path = head.split(b" ", 2)[:2]
            path = path.split(b"?")[0]
            if self.fault and method == b"POST" and path in GENERATION_PATHS:
                answer, close = self.faulty(body)
            else:
                answer, close = self.answer(method, path, body), b"connection: close" in lower
            if answer:
                self.transport.write(answer)
            if close:
                self.transport.close()
                return

    def faulty(self, body: bytes) -> tuple[bytes, bool]:
        """The answer to a generation request under `fault`, and whether to close the connection after it."""
        self.served += 1
        if self.fault == "close" or (self.fault == "close_reused" and self.served > 1):
            self.stats.generations += 1
            return b"", True
        if self.fault == "break" and b'"stream":true' in body.replace(b" ", b""):
            self.stats.generations += 1
            return BROKEN_STREAM, True
        if self.fault == "reject":
            self.stats.generations += 1
            return REJECT, False
        if self.fault == "headers_first" and b'"stream":true' in body.replace(b" ", b""):
            self.stats.generations += 1
            asyncio.get_running_loop().call_later(0.3, self._write_rest)
            return DECODE_STREAM[:STREAM_HEAD_END], False
        if self.fault == "trickle" and b'"stream":true' in body.replace(b" ", b""):
            self.stats.generations += 1
            for i, at in enumerate(range(0, len(DECODE_STREAM), TRICKLE_BYTES)):
                asyncio.get_running_loop().call_later(0.005 * i, self._write_rest, at, at + TRICKLE_BYTES)
            return b"", False
        return self.answer(b"POST", GENERATION_PATHS[0], body), False

    def _write_rest(self, start: int = STREAM_HEAD_END, end: int | None = None) -> None:
        if not self.transport.is_closing():
            self.transport.write(DECODE_STREAM[start:end])

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"POST" and path in GENERATION_PATHS:
            self.stats.generations += 1
            self.stats.paired += b'"bootstrap_room"' in body
            stream = b'"stream":true' in body.replace(b" ", b"")
            if self.role == "decode":
                return DECODE_STREAM if stream else DECODE_JSON
            return PREFILL_STREAM if stream else PREFILL_JSON
        if path == b"/health" or path == b"/health_generate":
            return _json_response({})
        if path == b"/abort_request":
            return _json_response({})
        if path == b"/metrics":
            text = b'sglang:token_usage{model_name="stub",engine_type="%s"} %.2f\n' % (self.role.encode(), self.stats.token_usage)
            return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
        if path == b"/stats":
            return _json_response({"generations": self.stats.generations, "paired": self.stats.paired})
        if path in (b"/model_info", b"/get_model_info"):
            return _json_response({"model_path": "stub", "served_model_name": "stub", "is_generation": True,
                                   "disaggregation_mode": self.role})
        if path in (b"/server_info", b"/get_server_info"):
            return _json_response({"disaggregation_mode": self.role, "tp_size": 1, "dp_size": 1,
                                   "disaggregation_bootstrap_port": self.port + 1, "max_total_num_tokens": 1 << 20,
                                   "max_req_input_len": 1 << 16, "internal_states": [{"memory_usage": {}}]})
        if path == b"/v1/models":
            return _json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})
        return _json_response({"error": {"message": f"no route {path.decode()}"}}, b"404 Not Found")


async def serve(role: str, host: str, port: int) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = await loop.create_server(lambda: StubProtocol(role, port, stats), sock=sock, backlog=1024)
    print(f"stub {role} ready on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


class StubThread:
    """A stub served from a thread on its own event loop (tests); `url`, `stats`, and `fault` to change."""

    def __init__(self, role: str, sock: socket.socket, fault: str | None = None) -> None:
        self.role, self.fault, self.stats = role, fault, Stats()
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stub-{role}-{self.port}", daemon=True)

    def _protocol(self) -> StubProtocol:
        return StubProtocol(self.role, self.port, self.stats, self.fault)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(self._loop.create_server(self._protocol, sock=self._sock))
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def __enter__(self) -> StubThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"stub {self.role} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.role, args.host, args.port))
    else:
        uvloop.run(serve(args.role, args.host, args.port))


if __name__ == "__main__":
    main()
