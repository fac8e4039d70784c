"""Both pools nearly full, and the two legs of each request reaching prefill and decode in opposite orders (the
router sends them at once; under load either may come first): a real pair serves every request exactly. The
prefill held computed KV for rooms the decode had not reserved while the decode held reservations for prompts the
prefill had no pages to compute, until the timeouts failed most requests (seen by the KV review: 3 to 8 of 8)."""

from __future__ import annotations

import asyncio
import secrets

import httpx

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

from tests.helpers import kv_used, wait_for
from tests.worker_procs import start_pair, stop_pair

POOL = ["--context-length", "512", "--max-total-tokens", "1024"]   # 64 pages: 2 of these requests at a time


def test_legs_in_opposite_orders_on_full_pools_all_finish_exactly(tmp_path):
    pair = start_pair(tmp_path, extra=POOL, prefill_extra=["--peer-timeout-s", "10"],
                      decode_extra=["--transfer-timeout-s", "20"])
    try:
        params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        bodies = [{"text": f"request {i}: " + "x" * 280, "sampling_params": params,
                   **pair.bootstrap(secrets.randbits(63), secrets.token_hex(8))} for i in range(8)]

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                prefill = [asyncio.create_task(c.post(pair.prefill_url + "/generate", json=b)) for b in bodies]
                await asyncio.sleep(0.3)
                decode = [asyncio.create_task(c.post(pair.decode_url + "/generate", json=b)) for b in bodies[::-1]]
                return await asyncio.gather(*prefill), await asyncio.gather(*decode)

        prefill, decode = asyncio.run(run())
        assert [r.status_code for r in prefill + decode] == [200] * 16, [r.text for r in prefill + decode]
        runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=1024, context_length=512))
        for body, answer in zip(bodies[::-1], decode):
            expected = generate_single_process(runner, ByteTokenizer().encode(body["text"]),
                                               SamplingParams(**params), EOS)
            assert answer.json()["output_ids"] == expected
        wait_for(lambda: kv_used(pair.prefill_url) == kv_used(pair.decode_url) == 0, 10, "every page back")
    finally:
        stop_pair(pair)
