"""The embedded prefill's prefix cache (workers/kv/prefix_cache.py): the radix tree's rules on a real pool, the prefill
engine reusing pages across prompts, and a real prefill -> NIXL -> decode pair whose cache hits change nothing in
the greedy output and show in usage and metrics."""

from __future__ import annotations

import asyncio
import re
import secrets

import httpx
import pytest

from dsv4_cluster.metric_names import KV_ALLOC_RUNS
from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.kv.prefix_cache import PrefixCache
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

from tests.worker_procs import start_pair, stop_pair

P = 4
TOK = ByteTokenizer()


def _pool(pages: int = 16) -> KVPool:
    return KVPool(PoolLayout(page_size=P, num_pages=pages, n_layers=1, head_dim=8, index_dim=4, ratio=4,
                             dtype="float32"))


def _prompt_pages(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], list]:
    """What the prefill engine does for one prompt: match, own pages for the rest, insert once computed."""
    cached, locked = cache.match(tokens)
    own = cache.pool.alloc(len(tokens) - len(cached) * P)
    return cached + own, cache.insert(tokens, cached + own, locked)


def test_match_takes_whole_pages_and_always_leaves_the_last_token_to_compute():
    pool = _pool()
    cache = PrefixCache(pool)
    a = list(range(10, 22))                                  # 12 tokens: 3 whole pages
    pages, path = _prompt_pages(cache, a)
    assert cache.cached_pages == 3 and [n.page for n in path] == pages[:3]
    assert cache.match(a + [99])[0] == pages[:3]             # 13 tokens: all 3 pages
    assert cache.match(a)[0] == pages[:2]                    # 12 tokens: the last page would leave nothing to compute
    assert cache.match(a[:6] + [0, 0, 0])[0] == pages[:1]    # diverges inside page 2
    assert cache.match([5] + a)[0] == []                     # a prefix, not a substring


def test_locked_pages_are_never_evicted_and_unlocked_ones_go_least_recently_used_first():
    pool = _pool(pages=8)
    cache = PrefixCache(pool)
    pages_a, lock_a = _prompt_pages(cache, list(range(0, 8)))        # 2 pages
    pages_b, lock_b = _prompt_pages(cache, list(range(100, 108)))    # 2 pages
    assert pool.free_pages == 4 and cache.evictable_pages == 0 and pool.used_tokens == 16
    cache.unlock(lock_a)
    assert cache.evictable_pages == 2 and pool.used_tokens == 8      # evictable pages count as available
    assert cache.evict(5) == 2 and pool.free_pages == 6              # only A's: B is locked
    assert cache.match(list(range(0, 9)))[0] == []
    cache.unlock(lock_b)
    pages_c, lock_c = _prompt_pages(cache, list(range(200, 205)))    # 1 whole page + 1 token
    cache.unlock(lock_c)
    _, relock = cache.match(list(range(100, 109)))                   # B used again: now the most recent
    cache.unlock(relock)
    assert cache.evict(1) == 1                                       # C's page: the least recently used leaf
    assert cache.match(list(range(200, 205)))[0] == []
    b, lock = cache.match(list(range(100, 109)))
    assert b == pages_b[:2]
    cache.unlock(lock)
    assert cache.flush() == 2 and cache.cached_pages == 0 and cache.evictable_pages == 0
    pool.release(pages_c[1:])                                        # C's own partial page
    assert pool.free_pages == 8 and pool.used_tokens == 0


def test_a_page_the_tree_has_under_another_page_stays_the_requests_own():
    pool = _pool()
    cache = PrefixCache(pool)
    t = list(range(30, 39))
    first_cached, lock1 = cache.match(t)
    second_cached, lock2 = cache.match(t)                             # both missed: computed concurrently
    p1 = pool.alloc(len(t))
    p2 = pool.alloc(len(t))
    path1 = cache.insert(t, p1, lock1)
    path2 = cache.insert(t, p2, lock2)
    assert [n.page for n in path2] == p1[:2]                          # the tree keeps the first request's pages
    assert not any(cache.owns(p) for p in p2)                         # the second's go back to the pool at its end
    cache.unlock(path1)
    cache.unlock(path2)
    pool.release([p for p in p1 + p2 if not cache.owns(p)])
    assert pool.used_tokens == 0 and cache.cached_pages == 2


def test_a_full_cache_under_multi_turn_churn_hands_out_few_runs_at_the_same_hit_rate():
    """The pool stays full of cached pages, so nearly every prompt evicts: evicting exactly what was short, least
    recently used leaf first, handed a request the scattered single pages of many old prompts (p50 23 runs, p99 65
    on this workload). Evicting a reserve, in long stretches of cold pages, keeps them to a few runs."""
    from bench.kv_cache_churn import Workload, run

    _, f = run(Workload())
    assert f["runs_p50"] <= 3 and f["runs_p99"] <= 8, f
    assert f["occupancy_mean"] >= 0.9 and f["hit_rate"] >= 0.25, f   # the pool stays full; hits as strict LRU's


def _prefill_engine(max_total_tokens: int):
    from dsv4_cluster.workers.prefill.engine import PrefillEngine

    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=max_total_tokens,
                                      context_length=1024))
    return PrefillEngine(runner, transfer=None, write_timeout_s=5)


def _prefill(engine, room: int, ids: list[int]):
    """One prompt through the prefill engine up to its first token; the request still holds its pages."""
    from dsv4_cluster.workers.engine.request import Req

    req = Req(rid=f"r{room}", prompt_ids=ids, params=SamplingParams(max_new_tokens=4, temperature=0),
              budget=len(ids) + 4, emit=lambda e: None, room=room)
    engine.on_submit(req)
    engine.reqs[req.rid] = req
    while engine.waiting:
        engine._prefill_batch()
    return req


def test_the_prefill_engine_reuses_a_shared_prefix_and_computes_the_same_first_token():
    engine = _prefill_engine(2048)
    runner = engine.runner
    system = TOK.encode("You are a helpful assistant. " * 6)               # shared system prompt, > 8 pages
    prompts = [system + TOK.encode(q) for q in ("What is 2+2?", "Name a colour.", "What is 2+2?")]
    got = []
    for i, ids in enumerate(prompts):
        req = _prefill(engine, i, ids)
        got.append((req.cached_tokens, req.out[0]))
        engine.finish(req)                                             # as after its KV went out
    assert got[0][0] == 0
    common = next(i for i, (x, y) in enumerate(zip(prompts[0], prompts[1])) if x != y)   # system prompt and more
    assert common >= len(system) and got[1][0] == common // 16 * 16
    assert got[2][0] == (len(prompts[2]) - 1) // 16 * 16                 # all of a repeated prompt but its last page
    plain = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=2048, context_length=1024))
    for (cached, first), ids in zip(got, prompts):
        assert first == generate_single_process(plain, ids, SamplingParams(max_new_tokens=1, temperature=0), EOS)[0]
    assert runner.pool.used_tokens == 0 and engine.cache.cached_pages > 0   # cached, but all evictable
    assert engine.cache.hit_rate == pytest.approx((got[1][0] + got[2][0]) / sum(map(len, prompts)))
    held = engine.cache.cached_pages
    assert engine.flush_cache() == held and engine.cache.cached_pages == 0 and runner.pool.free_pages == 2048 // 16


def _gauges(exposition: bytes) -> dict[str, float]:
    return {name.decode(): float(v) for name, v in re.findall(rb"^(sglang:\w+)\{[^}]*\} (\S+)$", exposition, re.M)}


def test_a_finished_prompt_kept_in_the_cache_is_evictable_not_used_as_sglang_counts_it():
    """SGLang's num_used_tokens is capacity - (available + evictable): the prompt a finished request leaves in the
    prefix cache is evictable, not used, and a repeat of it still hits; pages a request holds, cached ones it
    locked included, are used. The gauges add up to the capacity."""
    from dsv4_cluster.core import Role
    from dsv4_cluster.workers.http.metrics import WorkerMetrics

    engine = _prefill_engine(1024)
    metrics = WorkerMetrics(engine, "dsv4-tiny", Role.PREFILL, 1024)
    ids = TOK.encode("The same prompt, sent twice. " * 2)                # 58 tokens: 3 whole pages and a part
    first = _prefill(engine, 1, ids)
    g = _gauges(metrics.render())
    assert g["sglang:num_used_tokens"] == g["sglang:kv_used_tokens"] == 4 * 16 and g["sglang:kv_evictable_tokens"] == 0
    engine.finish(first)
    g = _gauges(metrics.render())
    assert engine.cache.cached_pages == 3
    assert (g["sglang:num_used_tokens"], g["sglang:kv_used_tokens"], g["sglang:token_usage"]) == (0, 0, 0)
    assert (g["sglang:kv_evictable_tokens"], g["sglang:kv_available_tokens"]) == (3 * 16, 1024 - 3 * 16)
    again = _prefill(engine, 2, ids)
    assert again.cached_tokens == 3 * 16                                 # the cache still hits
    g = _gauges(metrics.render())
    assert (g["sglang:num_used_tokens"], g["sglang:kv_evictable_tokens"]) == (4 * 16, 0)   # locked: used again
    engine.finish(again)
    g = _gauges(metrics.render())
    assert (g["sglang:num_used_tokens"], g["sglang:kv_evictable_tokens"]) == (0, 3 * 16)
    assert g["sglang:kv_available_tokens"] + g["sglang:kv_evictable_tokens"] == g["sglang:max_total_num_tokens"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    on = start_pair(tmp_path_factory.mktemp("cache-on"))
    off = start_pair(tmp_path_factory.mktemp("cache-off"), prefill_extra=["--disable-radix-cache"])
    yield on, off
    stop_pair(on)
    stop_pair(off)


async def _chat(pair, messages: list[dict]) -> dict:
    body = {"model": "dsv4-tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
            **pair.bootstrap(secrets.randbits(63), secrets.token_hex(8))}
    async with httpx.AsyncClient(timeout=60) as c:
        p, d = await asyncio.gather(c.post(pair.prefill_url + "/v1/chat/completions", json=body),
                                    c.post(pair.decode_url + "/v1/chat/completions", json=body))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    return d.json()


def _metric(pair, name: str, label: str = "") -> float:
    """The sum of the prefill's series `name` (those with `label`, e.g. 'le="1.0"', when given)."""
    text = httpx.get(pair.prefill_url + "/metrics").text
    found = re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M)
    return sum(float(v) for labels, v in found if not label or label in labels.split(","))


def test_a_multi_turn_chat_hits_the_cache_and_answers_exactly_as_without_it(pairs):
    """Sessions that resend a growing history with a shared system prompt: from the second turn on the prefill
    reuses the history's pages (usage and metrics say how many); every answer equals the cache-off pair's."""
    on, off = pairs
    system = {"role": "system", "content": "You answer in one short sentence. " * 4}
    history, cached = [system], []
    for turn in ("Hello there", "What is a page of KV?", "And a radix tree?"):
        history.append({"role": "user", "content": turn})
        a, b = asyncio.run(_chat(on, history)), asyncio.run(_chat(off, history))
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached.append(a["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
    assert cached[0] == 0 and 0 < cached[1] < cached[2]                 # the history grows, so do the hits
    assert _metric(on, "sglang:cached_tokens_total") == sum(cached)
    assert _metric(on, "sglang:cache_hit_rate") > 0 and _metric(off, "sglang:cache_hit_rate") == 0
    # the history stays cached once the turns ended: evictable, not in use (SGLang's num_used_tokens)
    assert _metric(on, "sglang:num_used_tokens") == 0 and _metric(on, "sglang:kv_evictable_tokens") > 0
    # every prompt's new pages came in one run (a fresh pool), each counted once in the allocator's histogram
    assert _metric(on, KV_ALLOC_RUNS + "_count") == 3 and _metric(on, KV_ALLOC_RUNS + "_sum") == 3
    assert _metric(on, KV_ALLOC_RUNS + "_bucket", 'le="1.0"') == 3
    flushed = httpx.post(on.prefill_url + "/flush_cache").json()
    assert flushed["success"] and flushed["freed_pages"] > 0
    again = asyncio.run(_chat(on, history[:2]))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # nothing left after the flush
