"""The scale-out benchmark's workload and client: multi-turn chat sessions over a shared system prompt.

`sessions` sessions of `turns` requests over one shared system prompt, as chat or as `/v1/completions` with the
whole history in `prompt` (`api`): each turn resends the history (the answers as received, a new user message), so
the prefix a prefill can serve grows turn by turn. Seeded random letters: two routers get the same bytes. `drive`
plays it closed-loop: `concurrency` users each take the next session, one request in flight, a random 0..`think_ms`
pause between turns (which also keeps equal-speed users out of lockstep, where round robin would keep a session on
one worker), over one keep-alive connection of raw HTTP/1.1 (a client library would cost the shared CPU more than
the router under test). Per request: written, first content event (TTFT), end, status, and the id
(`s<session>-t<turn>`) that ends the new user message as `[id:...]` and keys the stubs' records.

The floor, the least a PD router can do, to calibrate "router-added latency" on this machine:
`python -m bench.scaleout_load --port P --prefill URL BOOTSTRAP_PORT ... --decode URL ...` serves `/health` and
streamed generation POSTs: it adds `bootstrap_*` fields for a round-robin prefill, sends the body to that prefill and
a round-robin decode at once, drains the prefill's answer and relays the decode's byte for byte. No validation,
retries, health checks or metrics: not a router, a yardstick. What it adds over the stubs' own time is what the
client, the stubs and the kernel cost on this shared machine; what a real router adds beyond that is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson


@dataclass(frozen=True)
class Workload:
    sessions: int = 128
    turns: int = 4
    system_chars: int = 4096
    first_chars: int = 2048
    turn_chars: int = 1024
    max_tokens: int = 8
    think_ms: float = 400.0
    seed: int = 0
    api: str = "chat"          # or "completions": the same sessions, the whole history rendered into `prompt`


def completion_prompt(messages: list[dict]) -> str:
    """A whole chat history as one `/v1/completions` prompt (the client's own layout), ending where the answer goes."""
    return "".join(f"### {m['role']}\n{m['content']}\n\n" for m in messages) + "### assistant\n"


def request_body(w: Workload, model: str, messages: list[dict]) -> tuple[str, bytes]:
    """The path and body of one turn: chat with its messages, or completions with the history as its prompt."""
    if w.api == "completions":
        return "/v1/completions", orjson.dumps({"model": model, "prompt": completion_prompt(messages), "stream": True,
                                                "max_tokens": w.max_tokens})
    return "/v1/chat/completions", orjson.dumps({"model": model, "messages": messages, "stream": True,
                                                 "max_tokens": w.max_tokens})


def _text(rng: random.Random, chars: int) -> str:
    words = []
    while chars > 0:
        n = min(chars, rng.randint(2, 9))
        words.append("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=n)))
        chars -= n + 1
    return " ".join(words)


@dataclass
class Result:
    user: str
    status: int = 0
    sent: float = 0.0
    first: float | None = None
    end: float = 0.0
    content: str = ""
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent


@dataclass
class Session:
    index: int
    system: str
    user_texts: list[str]
    history: list[dict] = field(default_factory=list)


def sessions(w: Workload) -> list[Session]:
    rng = random.Random(w.seed)
    system = _text(rng, w.system_chars)
    return [Session(i, system, [_text(rng, w.first_chars)] + [_text(rng, w.turn_chars) for _ in range(w.turns - 1)])
            for i in range(w.sessions)]


async def read_answer(reader: asyncio.StreamReader, on_piece) -> bytes:
    """Read one HTTP/1.1 answer (chunked or content-length); `on_piece(raw)` gets its head and each piece of its body
    as read (chunk framing included); returns the head."""
    head = await reader.readuntil(b"\r\n\r\n")
    on_piece(head)
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:
        at = lower.find(b"content-length:")
        on_piece(await reader.readexactly(int(lower[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0))
        return head
    while True:
        size_line = await reader.readuntil(b"\r\n")
        data = await reader.readexactly(int(size_line.split(b";")[0], 16) + 2)
        on_piece(size_line + data)
        if data == b"\r\n":
            return head


class Connection:
    """One keep-alive HTTP/1.1 connection to the router."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: bytes, result: Result) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        result.sent = time.monotonic()
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n\r\n".encode() + body)
        parts, buffer, plain = [], [b""], []

        def on_piece(piece: bytes) -> None:    # each event as it arrives: the first content event is the TTFT
            if not result.status:
                result.status = int(piece.split(b" ", 2)[1])
                plain.append(b"transfer-encoding: chunked" not in piece.lower())
                return
            if plain[0]:
                result.error = piece.decode(errors="replace")[:300]
                return
            buffer[0] += piece.split(b"\r\n", 1)[1][:-2]
            while b"\n\n" in buffer[0]:
                event, buffer[0] = buffer[0].split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                parsed = orjson.loads(event[6:])
                if "error" in parsed:
                    result.error = str(parsed["error"])[:300]
                    continue
                choice = parsed["choices"][0]
                if text := (choice.get("delta") or {}).get("content") or choice.get("text"):
                    result.first = result.first or time.monotonic()
                    parts.append(text)

        await read_answer(self.reader, on_piece)
        result.end, result.content = time.monotonic(), "".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def turn(conn: Connection, w: Workload, model: str, session: Session, text: str, user: str) -> Result:
    """One turn of `session`: its history and a new user message ending in `[id:user]`; the history grows by both
    messages when the answer came whole."""
    result = Result(user)
    messages = [{"role": "system", "content": session.system}, *session.history,
                {"role": "user", "content": f"{text} [id:{user}]"}]
    try:
        await asyncio.wait_for(conn.post_stream(*request_body(w, model, messages), result), 120)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
        result.error, result.end = f"{type(exc).__name__}: {exc}", time.monotonic()
        conn.close()
    if result.error is None and result.status == 200:
        session.history += [messages[-1], {"role": "assistant", "content": result.content}]
    return result


async def drive(host: str, port: int, model: str, w: Workload, concurrency: int) -> list[Result]:
    """Play every session of `w` against the router at host:port; one Result per request sent."""
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions(w):
        queue.put_nowait(s)
    out: list[Result] = []

    async def user(rng: random.Random) -> None:
        conn = Connection(host, port)
        try:
            while not queue.empty():
                session: Session = queue.get_nowait()
                for i, text in enumerate(session.user_texts):
                    out.append(result := await turn(conn, w, model, session, text, f"s{session.index}-t{i}"))
                    if result.error or result.status != 200:
                        break       # the session cannot go on without its answer
                    await asyncio.sleep(rng.uniform(0, w.think_ms) / 1e3)
        finally:
            conn.close()

    await asyncio.gather(*(user(random.Random(w.seed * 1000 + i)) for i in range(concurrency)))
    return out


async def alone(host: str, port: int, model: str, w: Workload, repeats: int = 2) -> list[Result]:
    """The sanity probe of a prefix-aware router: one session of `w`'s shape played alone, then its last turn
    `repeats` times more (ids `sanity-t<turn>`, `sanity-r<i>`), without adding the repeats to the history; a router
    that routes by prefix sends them all to one prefill."""
    session = Session(-1, sessions(w)[0].system, sessions(Workload(**{**w.__dict__, "seed": w.seed + 1}))[0].user_texts)
    conn, out, last = Connection(host, port), [], len(session.user_texts) - 1
    try:
        for i, text in enumerate(session.user_texts):
            if i == last:     # the last turn, then its repeats, all over the same history
                history = list(session.history)
            out.append(await turn(conn, w, model, session, text, f"sanity-t{i}"))
        for r in range(repeats):
            session.history = list(history)
            out.append(await turn(conn, w, model, session, session.user_texts[-1], f"sanity-r{r}"))
    finally:
        conn.close()
    return out


# -- the floor relay ----------------------------------------------------------------------------------------------

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Upstream:
    """Idle keep-alive connections to one worker."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.idle = parts.hostname, parts.port, []

    async def connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)


class Floor:
    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str]) -> None:
        self.prefills = [(Upstream(url), boot) for url, boot in prefills]
        self.decodes = [Upstream(url) for url in decodes]
        self._p, self._d = itertools.count(), itertools.count()

    async def leg(self, upstream: Upstream, request: bytes, relay: asyncio.StreamWriter | None) -> None:
        reader, writer = await upstream.connection()
        writer.write(request)
        await read_answer(reader, relay.write if relay is not None else lambda piece: None)
        upstream.idle.append((reader, writer))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                at = lower.find(b"content-length:")
                body = await reader.readexactly(int(lower[at + 15:lower.find(b"\r\n", at)]) if at >= 0 else 0)
                path = head.split(b" ", 2)[1]
                if not body:
                    writer.write(OK)
                    continue
                data = orjson.loads(body)
                prefill, boot = self.prefills[next(self._p) % len(self.prefills)]
                decode = self.decodes[next(self._d) % len(self.decodes)]
                data.update(bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=secrets.randbits(63))
                payload = orjson.dumps(data)
                request = (b"POST %s HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: %d"
                           b"\r\n\r\n%s" % (path, len(payload), payload))
                drain = asyncio.get_running_loop().create_task(self.leg(prefill, request, None))
                await self.leg(decode, request, writer)
                await drain
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(port: int, floor: Floor) -> None:
    server = await asyncio.start_server(floor.handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", nargs=2, action="append", metavar=("URL", "BOOTSTRAP_PORT"), required=True)
    parser.add_argument("--decode", action="append", required=True)
    args = parser.parse_args()
    import uvloop
    uvloop.run(serve(args.port, Floor([(u, int(b)) for u, b in args.prefill], args.decode)))


if __name__ == "__main__":
    main()
