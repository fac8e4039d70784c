"""The soak of the reliability bench: N chat requests at concurrency C through the router of a running cluster.

Mixed: every other request streams; prompt lengths are drawn up to the context limit (prompt + output fill the
context for one request in ten); `max_tokens` 1-24; one streaming request in twenty hangs up after 2 tokens.
Reports outcomes (`reliability_clients.py`: zero `lost` and `hung` is the bar), p50/p99 end-to-end latency of
the completed ones, each process's RSS after the warm-up (the first tenth of the requests) and at the end
(growth < 10%), and the workers' KV usage once the load is over (must return to 0).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from dsv4_cluster.workers.engine.tokenizer import ByteTokenizer

from . import proc_probe
from .reliability_clients import Outcome, chat, pct
from .reliability_faults import Cluster, kv_back_to

CONTEXT = 512
GROWTH_LIMIT_PCT = 10.0


def _overhead() -> int:
    """Tokens the chat template adds around one user message (the prompt's own bytes are one token each)."""
    return len(ByteTokenizer().apply_chat_template([{"role": "user", "content": ""}]))


def plan(n: int, seed: int = 0) -> list[tuple[int, int, bool, int | None]]:
    """(prompt chars, max_tokens, stream, leave_after) per request."""
    rng, room = random.Random(seed), CONTEXT - _overhead() - 8   # "i: " prefix and a margin
    out = []
    for i in range(n):
        max_tokens = rng.randint(1, 24)
        chars = room - max_tokens if i % 10 == 0 else rng.randint(1, room - max_tokens)
        stream = i % 2 == 0
        leave = 2 if stream and i % 20 == 0 and max_tokens > 4 else None
        out.append((chars, max_tokens, stream, leave))
    return out


def _rss(pids: dict[str, int]) -> dict[str, int]:
    return {name: proc_probe.rss_bytes(pid) or 0 for name, pid in pids.items()}


async def soak(cluster: Cluster, requests: int, concurrency: int = 32) -> dict:
    rows = await asyncio.to_thread(cluster.rows)
    pids = {name: r["pid"] for name, r in rows.items() if r.get("pid")}
    text = "the quick brown fox jumps over the lazy dog while the cluster serves. " * 10
    work = plan(requests)
    warm_n = max(1, requests // 10)
    outcomes: list[Outcome] = []
    warm: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    warmed = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        chars, max_tokens, stream, leave = work[i]
        async with sem:
            prompt = (f"{i}: " + text * (chars // len(text) + 1))[:chars]
            outcomes.append(await chat(client, cluster.router_url, prompt, max_tokens, stream, leave_after=leave))
        if len(outcomes) == warm_n:
            warmed.set()

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(requests)]
        await warmed.wait()
        warm = _rss(pids)
        await asyncio.gather(*tasks)
    wall = time.monotonic() - started
    end = _rss(pids)
    kv_end = await kv_back_to(cluster, {"prefill": 0, "decode": 0})
    kinds = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "errored", "left", "reset", "hung", "lost")}
    latencies = [o.latency_s for o in outcomes if o.kind == "completed"]
    rss = {name: {"warm_mib": round(warm[name] / 2**20, 1), "end_mib": round(end[name] / 2**20, 1),
                  "growth_pct": round(100 * (end[name] - warm[name]) / warm[name], 2) if warm[name] else float("nan")}
           for name in pids}
    samples = [f"{o.kind}: {o.detail}"[:240] for o in outcomes if o.kind not in ("completed", "left")][:6]
    ok = (kinds["lost"] == kinds["hung"] == kinds["reset"] == 0 and len(outcomes) == requests
          and all(v["growth_pct"] < GROWTH_LIMIT_PCT for v in rss.values()) and all(v == 0 for v in kv_end.values()))
    return {"requests": requests, "concurrency": concurrency, **kinds, "p50_s": pct(latencies, 50),
            "p99_s": pct(latencies, 99), "wall_s": round(wall, 1), "rss": rss, "kv_end": kv_end,
            "near_context_requests": sum(1 for i in range(requests) if i % 10 == 0), "samples": samples, "ok": ok}
