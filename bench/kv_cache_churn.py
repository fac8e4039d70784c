"""A prefill pool with the prefix cache on, churned by multi-turn chat: how many runs a request's pages come in.

    python -m bench.kv_cache_churn [--pages 4096] [--sessions 400] [--requests 6000] [--seed 0]

The engine's own `KVPool`, `PrefixCache` and the prefill's allocation (`PrefixCache.allocate`) under `--sessions`
chats over one system prompt, `--in-flight` requests holding their pages at once, each prompt's whole pages into the
tree once prefilled: the pool stays full of cached pages, so every allocation evicts. Reported (JSON): a request's
own pages in how many runs (p50 / p90 / p99 / max after a warm-up), the hit rate, the pool's occupancy.
`bench/kv_transfer.py --pages cache` prepares its prefill pool with this workload.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from dataclasses import dataclass

from dsv4_cluster.orchestrator.load.loadgen import percentile
from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
from dsv4_cluster.workers.kv.prefix_cache import PrefixCache
from dsv4_cluster.workers.kv.transfer import page_runs


@dataclass(frozen=True)
class Workload:
    pages: int = 4096
    page_size: int = 16
    sessions: int = 400
    requests: int = 6000
    in_flight: int = 16
    system_tokens: int = 1000
    turn_tokens: tuple[int, int] = (20, 600)       # a user message and an answer: uniform in this range
    max_context: int = 8192                        # a session longer than this starts over
    warmup: int = 1000                             # requests before the measured ones (the pool fills first)
    seed: int = 0


def run(w: Workload, pool: KVPool | None = None) -> tuple[PrefixCache, dict]:
    """Drive the workload through a prefix cache on `pool` (default: a small float pool of `w.pages`); returns the
    cache (every request ended, the tree holding their pages) and the figures."""
    pool = pool or KVPool(PoolLayout(page_size=w.page_size, num_pages=w.pages, n_layers=1, head_dim=4, index_dim=4,
                                     ratio=4, dtype="float32"))
    cache, rng = PrefixCache(pool), random.Random(w.seed)
    system = [rng.randrange(256) for _ in range(w.system_tokens)]
    histories: list[list[int]] = [[] for _ in range(w.sessions)]
    flight: deque = deque()
    runs, used, prompt_tokens, cached_tokens = [], [], 0, 0
    for i in range(w.requests):
        s = rng.randrange(w.sessions)
        if len(system) + len(histories[s]) + 2 * w.turn_tokens[1] > w.max_context:
            histories[s] = []
        histories[s] += [rng.randrange(256) for _ in range(rng.randint(*w.turn_tokens))]   # the user's message
        prompt = system + histories[s]
        while len(flight) >= w.in_flight or (got := cache.allocate(prompt)) is None:
            if not flight:
                raise ValueError(f"a prompt of {len(prompt)} tokens does not fit {w.pages} pages: lower max_context")
            _end(cache, *flight.popleft())
        pages, own, nodes = got
        histories[s] += [rng.randrange(256) for _ in range(rng.randint(*w.turn_tokens))]   # the answer
        if i >= w.warmup:
            runs.append(len(page_runs(own, own)))
            used.append(1 - pool.free_pages / w.pages)
            prompt_tokens += len(prompt)
            cached_tokens += (len(pages) - len(own)) * w.page_size
        flight.append((prompt, pages, cache.insert(prompt, pages, nodes)))
    while flight:                                  # the last requests end too: the tree keeps their pages
        _end(cache, *flight.popleft())
    s = sorted(runs)
    figures = {"workload": w.__dict__, "requests_measured": len(s),
               "runs_p50": percentile(s, 50), "runs_p90": percentile(s, 90), "runs_p99": percentile(s, 99),
               "runs_max": s[-1], "hit_rate": round(cached_tokens / max(prompt_tokens, 1), 3),
               "occupancy_min": round(min(used), 3), "occupancy_mean": round(sum(used) / len(used), 3),
               "free_runs_at_end": len(pool.free_runs)}
    return cache, figures


def _end(cache: PrefixCache, prompt: list[int], pages: list[int], nodes) -> None:
    """A request ends: its path unlocked, its pages the tree does not hold back to the pool."""
    cache.unlock(nodes)
    cache.pool.release([p for p in pages if not cache.owns(p)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in Workload().__dict__.items():
        if not isinstance(default, tuple):
            p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    a = p.parse_args(argv)
    w = Workload(**{k: getattr(a, k) for k in Workload().__dict__ if hasattr(a, k)})
    _, figures = run(w)
    json.dump(figures, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
