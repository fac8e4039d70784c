"""What the relay and the migration helpers may ask of the request that owns the stream (`generation.Flight`).

`Flight` runs a request from its body to the last byte across attempts, and alone starts them; `relay.py` (D's
events to the client) and `migration.py` (what a broken stream needs to go on on a fresh pair) are helpers it calls,
which read its body and state and write to its client only through this interface. Kept apart so that the helpers
depend on it, not on `generation.py` (which imports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .state import RouterState


class StreamOwner(Protocol):
    state: RouterState
    path: str  # the generation route
    body: dict[str, Any]  # the client's validated body
    upstream: dict[str, Any]  # what the workers get: the body, plus the token ids a resume needs (`resume.py`)
    ids_asked: bool  # the router asked for those ids, the client did not: they are taken out of every event
    status: int  # 0 until the response head went out

    async def send_events(self, run: bytes, done: bool) -> None:
        """A run of the stream's events to the client in one write (the response head before the first);
        `done`: the write ends the body."""
