"""Where decode reserved KV for each bootstrap room (written by the bootstrap server, read by the prefill engine),
and the NIXL notifications prefill sends decode about a room."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from array import array
from dataclasses import dataclass

from ..engine.sampling import TokenLogprob


@dataclass(frozen=True)
class Destination:
    agent_name: str
    pages: list[int]
    arrived: float
    incarnation: int | None = None   # of the decode process that reserved `pages` (NixlTransfer)
    prompt: str | None = None        # `prompt_digest` of the decode's request (None: a decode that sends none)
    waits_s: float | None = None     # how long decode waits for the KV from its reservation (its transfer timeout)

    def given_up(self, now: float) -> bool:
        """Decode failed the request already (past its wait): its pages may be another request's by the time a WRITE
        would land (decode frees them at the latest 4 waits later), so none may start."""
        return self.waits_s is not None and now - self.arrived > self.waits_s


class Destinations:
    """Rooms -> where decode reserved KV. Written by the bootstrap server, read by the engine.

    A room goes put (decode reserved) -> taken (the engine starts its WRITE) -> done (the WRITE ended).
    Decode may `cancel` a room it gave up: if no WRITE was taken for it, none ever will be (later puts
    are refused and a waiting request fails at once), so decode can free the pages right away.
    """

    def __init__(self, ttl_s: float):
        self._lock = threading.Lock()
        self._by_room: dict[int, Destination] = {}
        self._taken: dict[int, str] = {}            # room -> decode agent, WRITE in flight
        self._cancelled: dict[int, float] = {}      # room -> when decode gave it up
        self._ttl_s = ttl_s

    def put(self, room: int, agent_name: str, pages: list[int], incarnation: int | None = None,
            prompt: str | None = None, waits_s: float | None = None) -> bool:
        """Record decode's pages for `room` (reserved by decode process `incarnation` for a request whose prompt has
        digest `prompt`, waited for `waits_s`); False if decode already cancelled it."""
        with self._lock:
            now = time.monotonic()
            self._by_room = {r: d for r, d in self._by_room.items() if now - d.arrived < self._ttl_s}
            self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < self._ttl_s}
            if room in self._cancelled:
                return False
            self._by_room[room] = Destination(agent_name, pages, now, incarnation, prompt, waits_s)
            return True

    def pages(self, room: int) -> list[int] | None:
        """The pages decode reserved for `room`, if it has (the engine's allocation follows their runs)."""
        with self._lock:
            dest = self._by_room.get(room)
            return dest.pages if dest is not None else None

    def take(self, room: int) -> Destination | None:
        """The engine is about to WRITE into the room's pages (until `done`)."""
        with self._lock:
            dest = self._by_room.pop(room, None)
            if dest is not None:
                self._taken[room] = dest.agent_name
            return dest

    def agent_of(self, room: int) -> str | None:
        """The decode agent of a room whose WRITE is in flight (it stays taken)."""
        with self._lock:
            return self._taken.get(room)

    def done(self, room: int) -> str | None:
        """The room's WRITE ended (or never started); returns the decode agent it was for."""
        with self._lock:
            return self._taken.pop(room, None)

    def cancelled(self, room: int) -> bool:
        with self._lock:
            return room in self._cancelled

    def discard(self, room: int) -> None:
        """Prefill gave the room up itself (its request failed before any WRITE)."""
        with self._lock:
            self._by_room.pop(room, None)

    def cancel(self, room: int) -> bool:
        """Decode gave the room up. True if a WRITE into its pages may still be in flight."""
        with self._lock:
            if room in self._taken:
                return True
            self._by_room.pop(room, None)
            self._cancelled[room] = time.monotonic()
            return False


def prompt_digest(prompt_ids: list[int]) -> str:
    """What a decode's reservation says of its request's prompt: a room names a request only as long as no two share
    it, so the prefill checks that the pages it writes were reserved for the prompt it computed."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).hexdigest()


def notif_message(room: int, first_token: int, cached_tokens: int = 0, logprob: TokenLogprob | None = None) -> bytes:
    """The KV-landed notification: the room, the first output token (sampled here) and, when the request asked for
    logprobs, that token's logprob and alternatives (`first_logprob`: [logprob, [[id, logprob], ...]]), so decode
    reports the prefill's true values, as SGLang's decode reads them from the prefill's metadata buffers."""
    msg = {"room": room, "first_token": first_token, "cached_tokens": cached_tokens}
    if logprob is not None:
        msg["first_logprob"] = logprob.to_wire()
    return json.dumps(msg).encode()


def failed_message(room: int, reason: str, may_land: bool = False) -> bytes:
    """Tells decode that no KV will come for `room`: it frees the room's pages now, or, with `may_land` (a
    cancelled WRITE NIXL could not stop), holds them until a later message for the room says it ended."""
    return json.dumps({"room": room, "failed": reason, **({"may_land": True} if may_land else {})}).encode()
