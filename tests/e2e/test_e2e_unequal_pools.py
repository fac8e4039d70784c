"""A cluster whose decode pool is 8x its prefill's (2,048 vs 16,384 tokens: decode holds every running request's KV,
the usual shape in production) serves 24 concurrent requests of 300 prompt + 100 output tokens through the router:
no errors, every reply's tokens and text byte-for-byte those of a single-process run. The decode holds more tokens
at once than the prefill's whole pool, so pages above the prefill's pool size are written into (the case the
prepared descriptor lists once got wrong: every such WRITE failed).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

from bench.local_cluster import write_topology

from tests.helpers import kv_used

pytestmark = pytest.mark.slow
TOK = ByteTokenizer()
PREFILL_TOKENS, DECODE_TOKENS, CONCURRENCY, PROMPT, OUTPUT = 2048, 16384, 24, 300, 100
DISTINCT = 8    # 8 prompts, 3 requests each: the single-process oracle runs 8 times, not 24


def _prompt(i: int) -> str:
    text = f"request family {i}: " + "".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(PROMPT))
    while len(TOK.encode(text)) > PROMPT:
        text = text[:-1]
    return text


async def _kv_used_peak(url: str, stop: asyncio.Event) -> int:
    """The most KV tokens the decode held at once while the load ran."""
    peak = 0
    while not stop.is_set():
        peak = max(peak, await asyncio.to_thread(kv_used, url))
        await asyncio.sleep(0.1)
    return peak


async def _load(router: str, decode: str) -> tuple[list[httpx.Response], int]:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_kv_used_peak(decode, stop))
    async with httpx.AsyncClient(timeout=600) as c:
        replies = await asyncio.gather(*(c.post(router + "/generate", json={
            "text": _prompt(i % DISTINCT),
            "sampling_params": {"max_new_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}})
            for i in range(CONCURRENCY)))
    stop.set()
    return replies, await watcher


def test_a_decode_pool_8x_the_prefills_serves_24_concurrent_requests_exactly(tmp_path):
    cluster = write_topology(tmp_path, context_length=1024, extra_prefill=f", max_total_tokens: {PREFILL_TOKENS}",
                             extra_decode=f", max_total_tokens: {DECODE_TOKENS}")
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=2048, context_length=1024))
    params = SamplingParams(max_new_tokens=OUTPUT, temperature=0, ignore_eos=True)
    expected = [generate_single_process(runner, TOK.encode(_prompt(i)), params, EOS) for i in range(DISTINCT)]
    with cluster.running():
        decode = f"http://127.0.0.1:{cluster.ports['decode']}"
        t0 = time.monotonic()
        replies, peak = asyncio.run(_load(cluster.router_url, decode))
        took = time.monotonic() - t0
    errors = [(r.status_code, r.text[:300]) for r in replies if r.status_code != 200]
    assert not errors, errors
    for i, r in enumerate(replies):
        body = r.json()
        assert body["meta_info"]["prompt_tokens"] == len(TOK.encode(_prompt(i % DISTINCT))) <= PROMPT
        assert body["output_ids"] == expected[i % DISTINCT], f"request {i} differs from a single-process run"
        assert body["text"].encode() == TOK.decode(expected[i % DISTINCT]).encode()
    # more tokens held at once than the prefill's pool has: some of the decode's pages lie above its page count
    assert peak > PREFILL_TOKENS, f"the decode never held more than {peak} tokens; the test proves nothing"
    print(f"{CONCURRENCY} requests x ({PROMPT} + {OUTPUT}) tokens in {took:.1f}s, 0 errors; decode KV peak "
          f"{peak} tokens (prefill pool {PREFILL_TOKENS})")
