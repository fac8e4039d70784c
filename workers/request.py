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

from .sampling import SamplingParams


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
class Token:
    token_id: int
    finish_reason: str | None          # None, "stop" or "length"


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


Event = Reserved | Token | Failed


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    budget: int                            # prompt + output tokens this request may hold
    emit: Callable[[Event], None]
    room: int | None = None
    state: ReqState = ReqState.WAITING_PAGES
    pages: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    last_token_time: float | None = None

    def finish_reason(self, eos_token_id: int, decode_text: Callable[[list[int]], str]) -> str | None:
        """Why generation ends after the last token, or None to go on (shared by every path)."""
        if self.out[-1] == eos_token_id and not self.params.ignore_eos:
            return "stop"
        if self.params.stop and any(s in decode_text(self.out[-16:]) for s in self.params.stop):
            return "stop"
        if len(self.out) >= self.params.max_new_tokens or len(self.prompt_ids) + len(self.out) >= self.budget:
            return "length"
        return None


def loop_emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Event], None]:
    """An `emit` for engine threads: puts events on `queue`, owned by `loop`."""

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    return emit
