"""HTTP probes of a running worker: readiness (every URL answers 200) and KV capacity/usage (`/server_info`, with
`sglang:num_used_tokens` from `/metrics` where SGLang's internal state lacks it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from dsv4_cluster.core import KvUsage

_USED_RE = re.compile(r"^sglang:num_used_tokens(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


class ProbeError(RuntimeError):
    """A worker answered, but not with what the protocol promises."""


def first_unready(client: httpx.Client, urls: tuple[str, ...]) -> str | None:
    """The first URL that does not answer 200 yet (with why), or None when all do."""
    for url in urls:
        try:
            r = client.get(url)
        except httpx.HTTPError as e:
            return f"{url}: {type(e).__name__}"
        if r.status_code != 200:
            return f"{url}: HTTP {r.status_code}"
    return None


def _used_from_metrics(client: httpx.Client, metrics_url: str) -> int:
    r = client.get(metrics_url)
    r.raise_for_status()
    values = [float(m) for m in _USED_RE.findall(r.text)]
    if not values:
        raise ProbeError(f"{metrics_url} has no sglang:num_used_tokens sample")
    return int(sum(values))


@dataclass(frozen=True)
class EngineInfo:
    """What `status` shows of a running engine beyond its process."""

    kv: KvUsage
    kernels: tuple[tuple[str, str], ...]  # (kernel, "reference" | "triton" | "off"); () if unreported


def engine_info(client: httpx.Client, server_info_url: str, metrics_url: str | None) -> EngineInfo:
    """KV capacity/usage and active kernels; raises httpx.HTTPError, ProbeError or ValueError."""
    r = client.get(server_info_url)
    r.raise_for_status()
    info = r.json()
    kernels = info.get("kernels")
    pairs = tuple(sorted((str(k), str(v)) for k, v in kernels.items())) if isinstance(kernels, dict) else ()
    return EngineInfo(kv_usage(client, server_info_url, info, metrics_url), pairs)


def kv_usage(client: httpx.Client, server_info_url: str, info: dict[str, Any],
             metrics_url: str | None) -> KvUsage:
    """KV capacity and usage in tokens from a /server_info answer (`info`), else /metrics."""
    if "max_total_num_tokens" not in info:
        raise ProbeError(f"{server_info_url} lacks max_total_num_tokens")
    capacity = int(info["max_total_num_tokens"])
    states = info.get("internal_states") or [{}]
    used = states[0].get("num_used_tokens")
    if used is None:
        if metrics_url is None:
            raise ProbeError(f"{server_info_url} lacks internal_states[0].num_used_tokens")
        return KvUsage(capacity, _used_from_metrics(client, metrics_url))
    return KvUsage(capacity, int(used))
