"""The scale-out benchmark's workload and client: multi-turn chat sessions over a shared system prompt.

`sessions` sessions of `turns` requests over one shared system prompt, as chat or as `/v1/completions` with the
whole history in `prompt` (`api`): each turn resends the history (the answers as received, a new user message), so
the prefix a prefill can serve grows turn by turn. Seeded random letters: two routers get the same bytes. `drive`
plays it closed-loop: `concurrency` users each take the next session, one request in flight, a random 0..`think_ms`
pause between turns (which also keeps equal-speed users out of lockstep, where round robin would keep a session on
one worker), over one keep-alive connection of raw HTTP/1.1 (a client library would cost the shared CPU more than
the router under test). Per request: written, first content event (TTFT), end, status, and the id
(`s<session>-t<turn>`) that ends the new user message as `[id:...]` and keys the stubs' records.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

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


class Connection:
    """One keep-alive HTTP/1.1 connection to the router."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: bytes, result: Result) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        result.sent = time.monotonic()
        self.writer.write(head + body)
        reader = self.reader
        status_line = await reader.readuntil(b"\r\n")
        result.status = int(status_line.split(b" ", 2)[1])
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" not in headers:
            at = headers.find(b"content-length:")
            length = int(headers[at + 15:headers.find(b"\r\n", at)]) if at >= 0 else 0
            payload = await reader.readexactly(length)
            result.end = time.monotonic()
            result.error = payload.decode(errors="replace")[:300]
            return
        buffer, parts = b"", []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            buffer += data[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                parsed = orjson.loads(event[6:])
                if "error" in parsed:
                    result.error = str(parsed["error"])[:300]
                    continue
                choice = parsed["choices"][0]
                piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                if piece:
                    if result.first is None:
                        result.first = time.monotonic()
                    parts.append(piece)
        result.end = time.monotonic()
        result.content = "".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


async def _user(host: str, port: int, model: str, w: Workload, queue: asyncio.Queue, out: list[Result],
                rng: random.Random) -> None:
    conn = Connection(host, port)
    try:
        while not queue.empty():
            session: Session = queue.get_nowait()
            for turn, text in enumerate(session.user_texts):
                result = Result(f"s{session.index}-t{turn}")
                text = f"{text} [id:{result.user}]"
                messages = [{"role": "system", "content": session.system}, *session.history,
                            {"role": "user", "content": text}]
                path, body = request_body(w, model, messages)
                try:
                    await asyncio.wait_for(conn.post_stream(path, body, result), 120)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
                    result.error, result.end = f"{type(exc).__name__}: {exc}", time.monotonic()
                    conn.close()
                out.append(result)
                if result.error or result.status != 200:
                    break       # the session cannot go on without its answer
                session.history += [{"role": "user", "content": text},
                                    {"role": "assistant", "content": result.content}]
                await asyncio.sleep(rng.uniform(0, w.think_ms) / 1e3)
    finally:
        conn.close()


async def drive(host: str, port: int, model: str, w: Workload, concurrency: int) -> list[Result]:
    """Play every session of `w` against the router at host:port; one Result per request sent."""
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions(w):
        queue.put_nowait(s)
    out: list[Result] = []
    await asyncio.gather(*(_user(host, port, model, w, queue, out, random.Random(w.seed * 1000 + i))
                           for i in range(concurrency)))
    return out


async def alone(host: str, port: int, model: str, w: Workload, repeats: int = 2) -> list[Result]:
    """The sanity probe of a prefix-aware router: one session of `w`'s shape played alone, turn after turn, then its
    last turn sent `repeats` times more (ids `sanity-t<turn>`, `sanity-r<i>`); a router that routes by prefix sends
    them all to one prefill."""
    session = Session(-1, sessions(w)[0].system, sessions(Workload(**{**w.__dict__, "seed": w.seed + 1}))[0].user_texts)
    conn, out = Connection(host, port), []
    try:
        for turn, text in enumerate(session.user_texts + [session.user_texts[-1]] * repeats):
            user = f"sanity-t{turn}" if turn < len(session.user_texts) else f"sanity-r{turn - len(session.user_texts)}"
            result = Result(user)
            messages = [{"role": "system", "content": session.system}, *session.history,
                        {"role": "user", "content": f"{text} [id:{user}]"}]
            await asyncio.wait_for(conn.post_stream(*request_body(w, model, messages), result), 60)
            out.append(result)
            if turn < len(session.user_texts) - 1:
                session.history += [messages[-1], {"role": "assistant", "content": result.content}]
    finally:
        conn.close()
    return out
