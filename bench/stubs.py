"""Stub PD workers: SGLang's PD protocol (docs/protocol.md) without a model, for the router's benchmarks and tests.

Raw asyncio HTTP/1.1 keep-alive, each answer one write on a TCP_NODELAY socket, so the stub is never the bottleneck.
`StubProtocol` answers at once (bench/router.py; the router's tests via tests/servers.py's `StubThread`; `/stats`
counts requests and those with bootstrap fields), or misbehaves as `FAULTS` says. `WorkerProtocol` models SGLang's
timing for bench/scaleout.py: a prefill tokenizes the prompt of its own chat template, matches its pages in its own
LRU prefix cache, prefills the uncached tokens on one FIFO and releases the KV by `bootstrap_room`; a decode waits
for that KV and streams a token per `token_ms`. Each request is recorded by the last `[id:...]` of its prompt
(`GET /scaleout/records`, `POST /scaleout/reset`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import time
from dataclasses import dataclass

import orjson

TOKENS, TRICKLE_BYTES = 8, 37
GENERATION_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/generate")
# no answer; a 2nd request unanswered; a stream broken after 2 events; a 400; a 500 (a decode's KV bootstrap failed); no
# answer, closed 50 ms later (a killed worker); a stream's head 0.3 s before its events; TRICKLE_BYTES pieces 5 ms apart
FAULTS = ("close", "close_reused", "break", "reject", "fail", "close_late", "headers_first", "trickle")
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
END = b"0\r\n\r\n"


def event(body: dict | bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: " + (body if isinstance(body, bytes) else orjson.dumps(body)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def choice(delta: dict, finish: object) -> dict:
    return {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def json_response(body: object, status: bytes = b"200 OK", kind: bytes = b"application/json") -> bytes:
    data = body if isinstance(body, bytes) else orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, kind, len(data), data)


def answer_json(content: str, finish: object) -> bytes:
    return json_response({"id": "stub", "object": "chat.completion", "created": 0, "model": "stub", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 4, "completion_tokens": TOKENS, "total_tokens": 4 + TOKENS}})


PREFILLED = {"type": "length", "length": 0}
DECODE_STREAM = SSE_HEAD + b"".join(event(choice({"role": "assistant", "content": f"t{i} "}, None))
                                    for i in range(TOKENS)) + event(choice({}, "stop")) + event(b"[DONE]") + END
PREFILL_STREAM = SSE_HEAD + event(choice({"role": "assistant", "content": "t"}, PREFILLED)) + event(b"[DONE]") + END
DECODE_JSON, PREFILL_JSON = answer_json("".join(f"t{i} " for i in range(TOKENS)), "stop"), answer_json("t", PREFILLED)
BROKEN_STREAM = DECODE_STREAM[:len(SSE_HEAD) + len(event(choice({"role": "assistant", "content": "t0 "}, None))) * 2]
REJECT = json_response({"error": {"message": "bad field", "type": "invalid_request_error"}}, b"400 Bad Request")
FAIL = json_response({"error": {"message": "KV bootstrap failed", "type": "internal"}}, b"500 Internal Server Error")


def is_stream(body: bytes) -> bool:
    return b'"stream":true' in body.replace(b" ", b"")


@dataclass
class Stats:
    generations: int = 0
    paired: int = 0
    token_usage: float = 0.0  # what `/metrics` reports as `sglang:token_usage`


class StubProtocol(asyncio.Protocol):
    """One keep-alive connection: parse requests (Content-Length bodies), answer each at once."""

    def __init__(self, role: str, port: int, stats: Stats, fault: str | None = None) -> None:
        self.role, self.port, self.stats, self.fault = role, port, stats, fault
        self.buffer, self.served = b"", 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if (sock := transport.get_extra_info("socket")) is not None:  # asyncio and uvloop set it already: said here
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # because the benchmarks rely on it

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, lower = self.buffer[:end], self.buffer[:end].lower()
            at = lower.find(b"content-length:")
            length = int(lower[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            body, self.buffer = self.buffer[end + 4: end + 4 + length], self.buffer[end + 4 + length:]
            if head.startswith(b"PRI * HTTP/2.0"):
                self.transport.close()
                return
            method, path = (parts := head.split(b" ", 2))[0], parts[1].split(b"?")[0]
            if self.fault and method == b"POST" and path in GENERATION_PATHS:
                answer, close = self.faulty(body)
            else:
                answer, close = self.answer(method, path, body), b"connection: close" in lower
            self.transport.write(answer)  # (nothing, for a fault that answers nothing)
            if close:
                self.transport.close()
                return

    def faulty(self, body: bytes) -> tuple[bytes, bool]:
        """The answer to a generation request under `fault`, and whether to close the connection after it."""
        self.served += 1
        fault, later = self.fault, asyncio.get_running_loop().call_later
        if (fault == "close_reused" and self.served == 1) or (
                not is_stream(body) and fault in ("break", "headers_first", "trickle")):
            return self.answer(b"POST", GENERATION_PATHS[0], body), False
        self.stats.generations += 1
        if fault == "headers_first":
            later(0.3, self._write_rest, len(SSE_HEAD))
        elif fault == "close_late":
            later(0.05, self.transport.close)
        elif fault == "trickle":
            for i, at in enumerate(range(0, len(DECODE_STREAM), TRICKLE_BYTES)):
                later(0.005 * i, self._write_rest, at, at + TRICKLE_BYTES)
        return {"break": BROKEN_STREAM, "reject": REJECT, "fail": FAIL, "headers_first": SSE_HEAD}.get(fault, b""), \
            fault in ("close", "close_reused", "break")

    def _write_rest(self, start: int, end: int | None = None) -> None:
        if not self.transport.is_closing():
            self.transport.write(DECODE_STREAM[start:end])

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"POST" and path in GENERATION_PATHS:
            self.stats.generations += 1
            self.stats.paired += b'"bootstrap_room"' in body
            stream, plain = (DECODE_STREAM, DECODE_JSON) if self.role == "decode" else (PREFILL_STREAM, PREFILL_JSON)
            return stream if is_stream(body) else plain
        if path == b"/metrics":
            return json_response(b'sglang:token_usage{model_name="stub",engine_type="%s"} %.2f\n'
                                 % (self.role.encode(), self.stats.token_usage), kind=b"text/plain")
        body = {b"/health": {}, b"/health_generate": {}, b"/abort_request": {},
                b"/stats": {"generations": self.stats.generations, "paired": self.stats.paired},
                b"/v1/models": {"object": "list", "data": [{"id": "stub", "object": "model"}]}}.get(path)
        if path.endswith(b"model_info") or path.endswith(b"server_info"):
            body = {"model_path": "stub", "served_model_name": "stub", "is_generation": True,
                    "disaggregation_mode": self.role} if path.endswith(b"model_info") else self.server_info()
        if body is None:
            return json_response({"error": {"message": f"no route {path.decode()}"}}, b"404 Not Found")
        return json_response(body)

    def server_info(self) -> dict:
        return {"disaggregation_mode": self.role, "tp_size": 1, "dp_size": 1, "max_total_num_tokens": 1 << 20,
                "disaggregation_bootstrap_port": self.port + 1, "max_req_input_len": 1 << 16,
                "internal_states": [{"memory_usage": {}}]}


# -- the SGLang-modelled workers of the scale-out benchmark -------------------------------------------------------

PAGE_TOKENS, KV_WAIT_S = 16, 30.0
TOKEN = re.compile(r"[A-Za-z]{1,6}|\d|\s|[^A-Za-z\d\s]")


@dataclass
class Model:
    """SGLang's cost model; `cache_tokens` (per prefill) is small enough that the workload evicts."""

    base_ms: float = 2.0
    per_token_us: float = 50.0
    cache_tokens: int = 16_384
    token_ms: float = 20.0


def prompt_of(body: dict) -> str:
    """The prompt as the model sees it: chat through a template of the stubs' own, completions as sent."""
    if "messages" in body:
        return "<|begin|>" + "".join(f"<|{m.get('role')}|>\n{m.get('content')}<|end|>\n" for m in body["messages"]
                                     if isinstance(m, dict)) + "<|assistant|>\n"
    prompt = body.get("prompt", body.get("text", ""))
    return prompt if isinstance(prompt, str) else str(prompt)


def tokens_of(text: str) -> list[str]:
    return TOKEN.findall(text)


def page_names(tokens: list[str]) -> list[int]:
    """One name per whole page of `PAGE_TOKENS` tokens, chained over the pages before it."""
    names, h = [], 0
    for i in range(0, len(tokens) - PAGE_TOKENS + 1, PAGE_TOKENS):
        h = hash((h, *tokens[i:i + PAGE_TOKENS]))
        names.append(h)
    return names


class Prefill:
    """One modelled prefill: its FIFO, counters and prefix cache (page names, LRU, `capacity` pages)."""

    def __init__(self, index: int, capacity: int) -> None:
        self.index, self.capacity, self.pages, self.busy_until = index, capacity, {}, 0.0
        self.evicted = self.requests = self.prompt_tokens = self.cached_tokens = 0

    def match(self, names: list[int]) -> int:
        return next((i for i, name in enumerate(names) if name not in self.pages), len(names))

    def insert(self, names: list[int]) -> None:
        for name in reversed(names):       # leaf first: the root ends most recent, evicted last
            self.pages.pop(name, None)
            self.pages[name] = None
        while len(self.pages) > self.capacity:
            del self.pages[next(iter(self.pages))]
            self.evicted += 1


class Farm:
    """What the stubs of one process share: the prefills (by bootstrap port), the KV by `bootstrap_room`, records."""

    def __init__(self, model: Model, prefills: list[int], decodes: int) -> None:
        self.model, self.decodes = model, decodes
        self.prefills = {boot: Prefill(i, model.cache_tokens // PAGE_TOKENS) for i, boot in enumerate(prefills)}
        self.reset()

    def record(self, body: dict) -> dict:
        text = prompt_of(body)
        at = text.rfind("[id:")
        return self.records.setdefault(text[at + 4:text.find("]", at)] if at >= 0 else "", {})

    def room(self, room: int) -> asyncio.Future:
        if room not in self.kv:
            self.kv[room] = asyncio.get_running_loop().create_future()
        return self.kv[room]

    def reset(self) -> None:
        self.prefills = {boot: Prefill(p.index, p.capacity) for boot, p in self.prefills.items()}
        self.kv, self.records, self.mispaired, self.errors = {}, {}, 0, []
        self.decode_requests = dict.fromkeys(range(self.decodes), 0)

    def report(self) -> dict:
        prefill = [{"index": p.index, "requests": p.requests, "prompt_tokens": p.prompt_tokens,
                    "cached_tokens": p.cached_tokens, "evicted_pages": p.evicted} for p in self.prefills.values()]
        return {"records": self.records, "mispaired": self.mispaired, "errors": self.errors[:20], "prefill": prefill,
                "decode_requests": self.decode_requests}


class WorkerProtocol(StubProtocol):
    """One connection to one modelled worker; generation requests are answered when the model says."""

    def __init__(self, farm: Farm, role: str, port: int, index: int, bootstrap_port: int = 0) -> None:
        super().__init__(role, port, Stats())
        self.farm, self.index, self.bootstrap_port, self.tasks = farm, index, bootstrap_port, set()

    def server_info(self) -> dict:
        return {"disaggregation_mode": self.role, "tp_size": 1, "dp_size": 1, "page_size": PAGE_TOKENS,
                "max_total_num_tokens": self.farm.model.cache_tokens}

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if path.startswith(b"/scaleout/"):
            if path == b"/scaleout/reset":
                self.farm.reset()
            return json_response(self.farm.report() if path == b"/scaleout/records" else {})
        if method != b"POST" or path not in GENERATION_PATHS:
            return super().answer(method, path, body)
        parsed = orjson.loads(body)
        if self.role == "prefill":
            self.prefill(parsed)
        else:
            self.tasks.add(task := asyncio.get_running_loop().create_task(self.decode(parsed)))
            task.add_done_callback(self.tasks.discard)
        return b""

    def prefill(self, body: dict) -> None:
        farm, now, model = self.farm, time.monotonic(), self.farm.model
        worker, rec = farm.prefills[self.bootstrap_port], farm.record(body)
        pieces = tokens_of(prompt_of(body))
        names = page_names(pieces)
        cached = worker.match(names) * PAGE_TOKENS
        worker.insert(names)
        worker.requests, worker.prompt_tokens = worker.requests + 1, worker.prompt_tokens + len(pieces)
        worker.cached_tokens += cached
        start = max(now, worker.busy_until)
        worker.busy_until = end = start + (model.base_ms + model.per_token_us * (len(pieces) - cached) / 1e3) / 1e3
        rec.update(prefill_arrival=now, prefill_start=start, prefill_end=end, prompt_tokens=len(pieces),
                   cached_tokens=cached, prefill=worker.index)
        farm.mispaired += body.get("bootstrap_port") != self.bootstrap_port
        asyncio.get_running_loop().call_later(end - time.monotonic(), self._prefilled, body.get("bootstrap_room"),
                                              bool(body.get("stream")))

    def _prefilled(self, room: int, stream: bool) -> None:
        if not (fut := self.farm.room(room)).done():
            fut.set_result(self.bootstrap_port)
        if not self.transport.is_closing():
            self.transport.write(PREFILL_STREAM if stream else PREFILL_JSON)

    async def decode(self, body: dict) -> None:
        farm, room = self.farm, body.get("bootstrap_room")
        farm.record(body).update(decode_arrival=time.monotonic(), decode=self.index)
        farm.decode_requests[self.index] = farm.decode_requests.get(self.index, 0) + 1
        try:
            port = await asyncio.wait_for(asyncio.shield(farm.room(room)), KV_WAIT_S)
        except asyncio.TimeoutError:
            farm.errors.append(f"decode {self.index}: no prefill released room {room} in {KV_WAIT_S:g} s")
            self.transport.write(json_response({"error": {"message": "KV never arrived"}}, b"500 Internal Server Error"))
            return
        farm.kv.pop(room, None)
        farm.mispaired += port != body.get("bootstrap_port")
        for i in range(int(body.get("max_tokens") or 8)):   # the first came from the prefill with the KV: at once
            if i:
                await asyncio.sleep(farm.model.token_ms / 1e3)
            if self.transport.is_closing():
                return
            piece = f"r{i}-{str(room)[-6:]} "
            data = event(choice({"role": "assistant", "content": piece}, None) if "messages" in body else
                         {"id": "stub", "object": "text_completion", "created": 0, "model": "stub",
                          "choices": [{"index": 0, "text": piece, "finish_reason": None}]})
            if not i:
                farm.record(body)["first_token"] = time.monotonic()
            self.transport.write(data if i else SSE_HEAD + data)
        self.transport.write(event(choice({}, "stop")) + event(b"[DONE]") + END)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["prefill", "decode"], help="one instant stub on --port")
    p.add_argument("--port", type=int)
    p.add_argument("--farm", type=orjson.loads, help='modelled workers: {"prefill": [[port, bootstrap port], ..], '
                   '"decode": [port, ..], "model": {Model\'s fields}}')
    a = p.parse_args()
    if a.role:
        stats = Stats()
        servers = [(a.port, lambda: StubProtocol(a.role, a.port, stats))]
    else:
        farm = Farm(Model(**a.farm.get("model", {})), [b for _, b in a.farm["prefill"]], len(a.farm["decode"]))
        servers = [(port, lambda p=port, i=i, b=boot: WorkerProtocol(farm, "prefill", p, i, b))
                   for i, (port, boot) in enumerate(a.farm["prefill"])]
        servers += [(port, lambda p=port, i=i: WorkerProtocol(farm, "decode", p, i))
                    for i, port in enumerate(a.farm["decode"])]
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        started = [await loop.create_server(factory, "127.0.0.1", port, backlog=1024, reuse_address=True)
                   for port, factory in servers]
        print(f"stubs ready on {[port for port, _ in servers]}", flush=True)
        await asyncio.gather(*(s.serve_forever() for s in started))

    uvloop.run(serve())


if __name__ == "__main__":
    main()
