"""What the relay and the migration helpers may ask of the request that owns the stream (`generation.Flight`).

`Flight` runs a request from its body to the last byte across attempts; `relay.py` (D's events to the client) and
`migration.py` (a broken stream continued on a fresh pair) are helpers it calls, which read its body and state,
write to its client and ask it for a fresh attempt only through this interface. Kept apart so that the helpers
depend on it, not on `generation.py` (which imports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .attempt import Attempt
    from .errors import RouterError
    from .state import RouterState
    from .worker import Worker


class StreamOwner(Protocol):
    state: RouterState
    path: str  # the generation route
    body: dict[str, Any]  # the client's validated body
    upstream: dict[str, Any]  # what the workers get: the body, plus the token ids a resume needs (`resume.py`)
    ids_asked: bool  # the router asked for those ids, the client did not: they are taken out of every event
    status: int  # 0 until the response head went out
    gone: bool  # the client left

    async def send(self, message: dict[str, Any]) -> None:
        """An ASGI message to the client."""

    def token_sent(self) -> None:
        """A piece of the answer reached the client (timing of the stream)."""

    async def start(self, body: dict[str, Any], avoid: set[Worker] | None = None,
                    failed: RouterError | None = None) -> Attempt:
        """A fresh attempt (held across a restart of the only worker of a role, within the request's deadline)."""

    async def answer(self, attempt: Attempt) -> None:
        """Answer the client with the attempt's decode response (status and body, not a stream)."""
