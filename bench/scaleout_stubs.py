"""Stub PD workers that model SGLang's timing, for the scale-out benchmark: N prefills and N decodes in one process.

`python -m bench.scaleout_stubs --prefill-ports P1 P2 .. --decode-ports D1 D2 .. --bootstrap-ports B1 ..`
serves every worker from one asyncio loop (128 servers on a 2-core machine cannot be 128 processes). Each speaks
the PD protocol as `router_stubs.py` does (same health/info/model routes; the Rust router's HTTP/2 probe refused),
with SGLang's cost model on the generation paths:

- A prefill renders the prompt (chat: through a chat template of its own, `<|role|>` markers; completions: the
  prompt as sent), tokenizes it (words in pieces of up to 6 letters, every other character a token: not the
  router's fixed-width character blocks), looks its pages (`PAGE_TOKENS` tokens, each named by a hash chained over
  the pages before it, so a set of names is a radix tree) up in its own prefix cache, and prefills the uncached
  tokens: `base_ms + per_token_us * uncached` on one FIFO queue (one forward at a time, as one SGLang scheduler).
  Its cache holds `cache_tokens` tokens of pages, least recently used out first; a prompt's pages are touched
  leaf first so that parents outlive their children, as a radix tree evicts leaves. It answers when the prefill
  is done (one token, `finish_reason` length 0, like SGLang's prefill in PD mode) and releases the KV by
  `bootstrap_room` to the decode.
- A decode waits for its prefill's KV by `bootstrap_room` (the prefill must have been named by the same
  `bootstrap_port`, or the request counts as mispaired), then streams `max_tokens` tokens (the first at once: it
  came from the prefill with the KV, as in SGLang's PD), one event every `token_ms` after it (it batches: no
  queue), a stop event and `data: [DONE]`.

Every request is recorded by the last id its prompt carries (`[id:s3-t1]`, set by the load generator at the end of
each user message: routers forward prompts verbatim): arrival at each leg, prefill start/end, first token written, prompt and cached tokens, the worker.
`GET /scaleout/records` on any port returns them and the per-worker counters, `POST /scaleout/reset` clears them
and every cache (between two routers' runs). Times are `time.monotonic()`, one clock for every process here.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field

import orjson

from .router_stubs import GENERATION_PATHS, StubProtocol, _chunk, _json_response, _choice, _event

PAGE_TOKENS = 16
KV_WAIT_S = 30.0
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
TOKEN = re.compile(r"[A-Za-z]{1,6}|\d|\s|[^A-Za-z\d\s]")   # a word in pieces of up to 6 letters, or one character


@dataclass
class Model:
    """SGLang's cost model; the defaults are what `scaleout.py` runs. `cache_tokens` is small enough that the
    workload evicts (the stubs report it as `max_total_num_tokens`)."""

    base_ms: float = 2.0
    per_token_us: float = 50.0
    cache_tokens: int = 16_384
    token_ms: float = 20.0


def prompt_of(body: dict) -> str:
    """The prompt as the model sees it: chat messages through a chat template (not the router's `<role>content`),
    completions' prompt as is."""
    if "messages" in body:
        turns = "".join(f"<|{m.get('role')}|>\n{m.get('content')}<|end|>\n" for m in body["messages"]
                        if isinstance(m, dict))
        return "<|begin|>" + turns + "<|assistant|>\n"
    prompt = body.get("prompt", body.get("text", ""))
    return prompt if isinstance(prompt, str) else str(prompt)


def tokens_of(text: str) -> list[str]:
    return TOKEN.findall(text)


def page_names(tokens: list[str]) -> list[int]:
    """One name per whole page of `PAGE_TOKENS` tokens, chained over the pages before it (a radix tree's path)."""
    names, h = [], 0
    for i in range(0, len(tokens) - PAGE_TOKENS + 1, PAGE_TOKENS):
        h = hash((h, *tokens[i:i + PAGE_TOKENS]))
        names.append(h)
    return names


class PrefixCache:
    """One prefill's cache: page names, LRU, `capacity` pages."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.pages: dict[int, None] = {}
        self.evicted = 0

    def match(self, names: list[int]) -> int:
        n = 0
        for name in names:
            if name not in self.pages:
                break
            n += 1
        return n

    def insert(self, names: list[int]) -> None:
        pages = self.pages
        for name in reversed(names):       # leaf first: the root ends most recent, evicted last
            pages.pop(name, None)
            pages[name] = None
        while len(pages) > self.capacity:
            del pages[next(iter(pages))]
            self.evicted += 1


@dataclass
class Prefill:
    index: int
    bootstrap_port: int
    cache: PrefixCache
    busy_until: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Farm:
    """Everything the stubs of one process share: the model, the prefills, the KV hand-off, the records."""

    model: Model
    prefills: dict[int, Prefill] = field(default_factory=dict)      # by bootstrap port
    kv: dict[int, asyncio.Future] = field(default_factory=dict)      # bootstrap_room -> future(bootstrap port)
    records: dict[str, dict] = field(default_factory=dict)
    decode_requests: dict[int, int] = field(default_factory=dict)   # by decode index
    mispaired: int = 0
    errors: list[str] = field(default_factory=list)

    def record(self, body: dict) -> dict:
        """The record of the request whose prompt's last `[id:...]` names it (scaleout_load.py puts it there)."""
        text = prompt_of(body)
        at = text.rfind("[id:")
        return self.records.setdefault(text[at + 4:text.find("]", at)] if at >= 0 else "", {})

    def room(self, room: int) -> asyncio.Future:
        fut = self.kv.get(room)
        if fut is None:
            fut = self.kv[room] = asyncio.get_running_loop().create_future()
        return fut

    def reset(self) -> None:
        for p in self.prefills.values():
            p.cache = PrefixCache(p.cache.capacity)
            p.busy_until, p.requests, p.prompt_tokens, p.cached_tokens = 0.0, 0, 0, 0
        self.kv.clear()
        self.records.clear()
        self.decode_requests = dict.fromkeys(self.decode_requests, 0)
        self.mispaired, self.errors = 0, []

    def report(self) -> dict:
        return {"records": self.records, "mispaired": self.mispaired, "errors": self.errors[:20],
                "prefill": [{"index": p.index, "requests": p.requests, "prompt_tokens": p.prompt_tokens,
                             "cached_tokens": p.cached_tokens, "evicted_pages": p.cache.evicted}
                            for p in self.prefills.values()],
                "decode_requests": self.decode_requests}


class WorkerProtocol(StubProtocol):
    """One connection to one modeled worker; generation requests are answered when the model says."""

    def __init__(self, farm: Farm, role: str, port: int, index: int, bootstrap_port: int = 0) -> None:
        super().__init__(role, port, _NoStats())
        self.farm, self.index, self.bootstrap_port = farm, index, bootstrap_port

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if path == b"/scaleout/records":
            return _json_response(self.farm.report())
        if path == b"/scaleout/reset":
            self.farm.reset()
            return _json_response({})
        if path in (b"/server_info", b"/get_server_info"):
            return _json_response({"disaggregation_mode": self.role, "tp_size": 1, "dp_size": 1, "page_size": PAGE_TOKENS,
                                   "max_total_num_tokens": self.farm.model.cache_tokens})
        if method != b"POST" or path not in GENERATION_PATHS:
            return super().answer(method, path, body)
        parsed = orjson.loads(body)
        if self.role == "prefill":
            self.prefill(parsed)
        else:
            asyncio.get_running_loop().create_task(self.decode(parsed))
        return b""

    def prefill(self, body: dict) -> None:
        farm, now = self.farm, time.monotonic()
        worker = farm.prefills[self.bootstrap_port]
        rec = farm.record(body)
        pieces = tokens_of(prompt_of(body))
        names = page_names(pieces)
        tokens = len(pieces)
        cached = worker.cache.match(names) * PAGE_TOKENS
        worker.cache.insert(names)
        worker.requests += 1
        worker.prompt_tokens += tokens
        worker.cached_tokens += cached
        start = max(now, worker.busy_until)
        end = start + (farm.model.base_ms + farm.model.per_token_us * (tokens - cached) / 1e3) / 1e3
        worker.busy_until = end
        rec.update(prefill_arrival=now, prefill_start=start, prefill_end=end, prompt_tokens=tokens,
                   cached_tokens=cached, prefill=worker.index)
        room, stream = body.get("bootstrap_room"), bool(body.get("stream"))
        if body.get("bootstrap_port") != self.bootstrap_port:
            farm.mispaired += 1
        asyncio.get_running_loop().call_later(end - time.monotonic(), self._prefilled, room, stream)

    def _prefilled(self, room: int, stream: bool) -> None:
        fut = self.farm.room(room)
        if not fut.done():
            fut.set_result(self.bootstrap_port)
        if not self.transport.is_closing():
            event = _event(_choice({"role": "assistant", "content": "t"}, {"type": "length", "length": 0}))
            if stream:
                self.transport.write(SSE_HEAD + _chunk(event) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                self.transport.write(_json_response({"id": "stub", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "t"},
                     "finish_reason": {"type": "length", "length": 0}}]}))

    async def decode(self, body: dict) -> None:
        farm = self.farm
        rec = farm.record(body)
        rec.update(decode_arrival=time.monotonic(), decode=self.index)
        farm.decode_requests[self.index] = farm.decode_requests.get(self.index, 0) + 1
        room = body.get("bootstrap_room")
        try:
            port = await asyncio.wait_for(asyncio.shield(farm.room(room)), KV_WAIT_S)
        except asyncio.TimeoutError:
            farm.errors.append(f"decode {self.index}: no prefill released room {room} in {KV_WAIT_S:g} s")
            self.transport.write(_json_response({"error": {"message": "KV never arrived"}}, b"500 Internal Server Error"))
            return
        farm.kv.pop(room, None)
        if port != body.get("bootstrap_port"):
            farm.mispaired += 1
        tokens, token_s = int(body.get("max_tokens") or 8), farm.model.token_ms / 1e3
        tag, chat = str(body.get("bootstrap_room"))[-6:], "messages" in body
        first = True
        for i in range(tokens):   # the first token came from the prefill with the KV: it goes out at once
            if i:
                await asyncio.sleep(token_s)
            if self.transport.is_closing():
                return
            piece = f"r{i}-{tag} "
            data = _chunk(_event(_choice({"role": "assistant", "content": piece}, None) if chat else
                                 {"id": "stub", "object": "text_completion", "created": 0, "model": "stub",
                                  "choices": [{"index": 0, "text": piece, "finish_reason": None}]}))
            if first:
                rec["first_token"] = time.monotonic()
                data, first = SSE_HEAD + data, False
            self.transport.write(data)
        self.transport.write(_chunk(_event(_choice({}, "stop"))) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


class _NoStats:
    generations = paired = 0
    token_usage = 0.0


async def serve(farm: Farm, prefill_ports: list[int], bootstrap_ports: list[int], decode_ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for i, (port, boot) in enumerate(zip(prefill_ports, bootstrap_ports)):
        farm.prefills[boot] = Prefill(i, boot, PrefixCache(farm.model.cache_tokens // PAGE_TOKENS))
        servers.append(await loop.create_server(lambda p=port, i=i, b=boot: WorkerProtocol(farm, "prefill", p, i, b),
                                                "127.0.0.1", port, backlog=1024, reuse_address=True))
    for i, port in enumerate(decode_ports):
        farm.decode_requests[i] = 0
        servers.append(await loop.create_server(lambda p=port, i=i: WorkerProtocol(farm, "decode", p, i),
                                                "127.0.0.1", port, backlog=1024, reuse_address=True))
    print(f"scaleout stubs ready: {len(prefill_ports)} prefill, {len(decode_ports)} decode", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-ports", type=int, nargs="+", required=True)
    parser.add_argument("--bootstrap-ports", type=int, nargs="+", required=True)
    parser.add_argument("--decode-ports", type=int, nargs="+", required=True)
    for name, default in vars(Model()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()
    if len(args.prefill_ports) != len(args.bootstrap_ports):
        parser.error("give one --bootstrap-ports entry per --prefill-ports entry")
    model = Model(**{k: getattr(args, k) for k in vars(Model())})
    import uvloop
    uvloop.run(serve(Farm(model), args.prefill_ports, args.bootstrap_ports, args.decode_ports))


if __name__ == "__main__":
    main()
