"""Stranded KV on the prefill: a room whose KV has been ready for `detect_s` without a decode's reservation (its
decode died, the router lost the leg, a prefill leg sent alone) is counted from then on, and freed `timeout_s`
after its KV was ready, its request failing with a 500 naming the room. The net under the router's abort by rid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dsv4_cluster import metric_names as m

from ..engine.request import Req

STRANDED_AFTER_S = 5.0  # a decode reserves within milliseconds of its leg arriving, unless its pool is full


@dataclass
class StrandedKV:
    timeout_s: float
    page_size: int
    tokens: int = 0
    rooms: int = 0
    freed_tokens: int = 0
    freed_rooms: int = 0

    @property
    def detect_s(self) -> float:
        return min(STRANDED_AFTER_S, self.timeout_s / 2)

    def scan(self, waiting: Iterable[tuple[Req, float]], now: float) -> list[Req]:
        """Recount the stranded rooms among `waiting` (KV ready since the float, no reservation yet);
        returns the requests whose deadline has passed (the caller frees them, then calls `freed`)."""
        pages: set[int] = set()                 # distinct: prompts sharing cached pages hold them once
        rooms = 0
        expired = []
        for req, ready_at in waiting:
            held = now - ready_at
            if held >= self.timeout_s:
                expired.append(req)
            elif held >= self.detect_s:
                pages.update(req.pages)
                rooms += 1
        self.tokens, self.rooms = len(pages) * self.page_size, rooms
        return expired

    def late(self, preempted: Iterable[tuple[Req, float | None]], now: float) -> list[Req]:
        """Those of `preempted` (prompts waiting to be computed again, their KV first ready at the float, None if it
        never was) past their deadline: failed where they wait, not computed again for a decode that did not come."""
        return [req for req, ready_at in preempted if ready_at is not None and now - ready_at >= self.timeout_s]

    def freed(self, req: Req, pages: int) -> None:
        """`req` is about to be failed because no decode came for it, which frees `pages` pages (those no other
        request holds: a page of the prefix cache shared with another prompt stays)."""
        self.freed_tokens += pages * self.page_size
        self.freed_rooms += 1

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """(kind, name, help, value) of what the worker exports (names: dsv4_cluster.metric_names)."""
        return [
            ("gauge", m.STRANDED_KV_TOKENS, "KV tokens held for rooms no decode has reserved within the "
                                            "detection time (freed at the stranded-KV deadline)", self.tokens),
            ("gauge", m.STRANDED_KV_ROOMS, "Bootstrap rooms whose KV is stranded now", self.rooms),
            ("counter", m.STRANDED_KV_FREED_TOKENS, "Stranded KV tokens freed at the deadline", self.freed_tokens),
            ("counter", m.STRANDED_KV_FREED_ROOMS, "Stranded rooms freed at the deadline", self.freed_rooms),
        ]
