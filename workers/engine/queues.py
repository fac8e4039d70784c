"""A role engine's requests by state: one queue object per `ReqState` it holds requests in, as SGLang's
disaggregation code keeps its bootstrap, waiting and inflight queues, so a request sits in one place and its
state names that place."""

from __future__ import annotations

from typing import Generic, TypeVar

from .request import Req, ReqState

T = TypeVar("T")


class ReqQueue(Generic[T]):
    """The requests in one state, in arrival order, each with what that state keeps for it (a `T`)."""

    def __init__(self, state: ReqState) -> None:
        self.state = state
        self._items: dict[Req, T] = {}

    def put(self, req: Req, item: T) -> None:
        req.state = self.state
        self._items[req] = item

    def pop(self, req: Req) -> T | None:
        return self._items.pop(req, None)

    def items(self) -> list[tuple[Req, T]]:
        """A copy, so the caller may move requests out while it walks them."""
        return list(self._items.items())

    def __iter__(self):
        return iter(list(self._items))

    def __contains__(self, req: Req) -> bool:
        return req in self._items

    def __len__(self) -> int:
        return len(self._items)
