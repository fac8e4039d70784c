"""One request inside an engine, and the events an engine sends back to the HTTP handler.

The engine thread owns `Req`; the HTTP handler only reads the events it is sent through `emit`,
which hops them onto the server's event loop.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from . import tokenizer
from .sampling import SamplingParams, TokenLogprob


class ReqState(enum.Enum):
    WAITING_PAGES = "waiting_pages"        # queued until the pool has room
    WAITING_PEER = "waiting_peer"          # prefill: KV computed, decode has not reserved yet;
                                           # decode: pages reserved, KV not arrived yet
    TRANSFERRING = "transferring"          # prefill: WRITE in flight
    RUNNING = "running"                    # decode: in the continuous batch
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True)
class Reserved:
    """Decode reserved KV pages for the request; the handler now tells the prefill where."""

    pages: list[int]


@dataclass(frozen=True)
class Finish:
    """Why generation ended: "stop" (EOS, a stop token id or a stop string: `matched`) or "length"."""

    reason: str
    matched: str | int | None = None


@dataclass(frozen=True)
class Token:
    token_id: int
    finish: Finish | None = None
    cached_tokens: int | None = None   # on a request's first token: prompt tokens whose KV came from the prefix cache
    logprob: TokenLogprob | None = None   # when the request asked for logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.finish.reason if self.finish else None


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


@dataclass(frozen=True)
class Aborted:
    """Ended through /abort_request: SGLang ends such a request as finished (finish_reason "abort", no error status),
    with the output so far."""

    message: str


Event = Reserved | Token | Failed | Aborted


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    budget: int                            # prompt + output tokens this request may hold
    emit: Callable[[Event], None]
    room: int | None = None
    bootstrap: str | None = None           # the paired prefill's bootstrap server, http://host:port
    state: ReqState = ReqState.WAITING_PAGES
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0                     # prompt tokens whose KV is computed (chunked prefill)
    cached_tokens: int = 0                 # of those, taken from the prefix cache (prefix_cache.py)
    first_ready: float | None = None       # prefill: computed once (KV ready then), gave its pages up, computed again
    out: list[int] = field(default_factory=list)
    first_logprob: TokenLogprob | None = None   # prefill: the first output token's, carried to decode with it
    created: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self._wide = tokenizer.multibyte(self.prompt_ids)

    def next_ids(self) -> tuple[int, ...]:
        """The ids the next output token may be (`tokenizer.next_ids`)."""
        return tokenizer.next_ids(self.prompt_ids, self.out, self._wide)

    def finished(self, eos_token_id: int) -> Finish | None:
        """Why generation ends after the last token, or None to go on (shared by every path).

        Token ids below 256 are bytes (tokenizer.py), so a stop string matches when the output's bytes (its text:
        special tokens, an EOS with `ignore_eos`, have none) end with its UTF-8 bytes; checking after every token
        finds each match at its last byte.
        """
        last = self.out[-1]
        if last == eos_token_id and not self.params.ignore_eos:
            return Finish("stop", last)
        if last in self.params.stop_token_ids:
            return Finish("stop", last)
        for stop in self.params.stop:
            if self._text_ends_with(stop.encode()):
                return Finish("stop", stop)
        if len(self.out) >= self.params.max_new_tokens or len(self.prompt_ids) + len(self.out) >= self.budget:
            return Finish("length")
        return None

    def _text_ends_with(self, tail: bytes) -> bool:
        got = bytearray()
        for i in reversed(self.out):
            if len(got) == len(tail):
                break
            if i < 256:
                got.append(i)
        return got[::-1] == tail


class LoopEmitter:
    """An `emit` for engine threads: puts events on `queue`, owned by `loop`.

    Called directly it hops one event onto the loop; an engine batches the events of one step
    (`Outbox`) so that a decode step over B requests wakes the server's loop once, not B times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class Outbox:
    """Events an engine step emitted, delivered together when the step ends (engine thread only)."""

    def __init__(self) -> None:
        self._items: list[tuple[Callable[[Event], None], Event]] = []

    def wrap(self, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        return lambda event: self._items.append((emit, event))

    def flush(self) -> None:
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        for emit, event in items:
            if isinstance(emit, LoopEmitter):
                by_loop.setdefault(emit.loop, []).append((emit.queue, event))
            else:
                emit(event)
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
