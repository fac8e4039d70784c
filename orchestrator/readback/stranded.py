"""Stranded KV as `status` shows it, read from a prefill's `/metrics`; None for a worker that exports none (SGLang),
so `status` shows nothing rather than a zero nobody measured.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dsv4_cluster import metric_names as m
from dsv4_cluster.core import StrandedKv, WorkerStatus

if TYPE_CHECKING:
    import httpx  # the caller's client: the status table imports this module without it

_FIELDS = {m.STRANDED_KV_TOKENS: "tokens", m.STRANDED_KV_ROOMS: "rooms",
           m.STRANDED_KV_FREED_TOKENS: "freed_tokens", m.STRANDED_KV_FREED_ROOMS: "freed_rooms"}
_SAMPLE = re.compile(r"^(dsv4_stranded_kv_[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


def parse_stranded_kv(text: str) -> StrandedKv | None:
    """The stranded-KV numbers of a Prometheus text page; None when absent."""
    found: dict[str, int] = {}
    for name, value in _SAMPLE.findall(text):
        if name in _FIELDS:
            found[_FIELDS[name]] = found.get(_FIELDS[name], 0) + int(float(value))
    return StrandedKv(**found) if len(found) == len(_FIELDS) else None


def stranded_kv(client: httpx.Client, metrics_url: str) -> StrandedKv | None:
    """The worker's stranded-KV numbers now; raises httpx.HTTPError when `/metrics` does not answer."""
    r = client.get(metrics_url)
    r.raise_for_status()
    return parse_stranded_kv(r.text)


def stranded_line(row: WorkerStatus) -> str | None:
    """The status line of one worker row that carries stranded-KV numbers."""
    s = row.stranded_kv
    if not s:
        return None
    return (f"{row.name}: stranded KV {_count(s.tokens, 'token')} in {_count(s.rooms, 'room')} now; freed "
            f"{_count(s.freed_tokens, 'token')} in {_count(s.freed_rooms, 'room')} since it started")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
