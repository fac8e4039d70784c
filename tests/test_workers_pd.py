"""A real embedded prefill and decode process pair, driven over HTTP as the router drives them."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys

import httpx
import pytest

from dsv4_cluster.workers.model import ModelConfig
from dsv4_cluster.workers.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.sampling import SamplingParams
from dsv4_cluster.workers.tokenizer import EOS, ByteTokenizer

from .servers import free_port
from .worker_procs import _wait, start_pair, stop_pair

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = start_pair(tmp_path_factory.mktemp("pair"), prefill_extra=["--peer-timeout-s", "3"],
                   decode_extra=["--transfer-timeout-s", "3"])
    yield p
    stop_pair(p)


async def _both(pair, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    body = {**body, **pair.bootstrap(secrets.randbits(63), secrets.token_hex(8))}
    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(c.post(pair.prefill_url + path, json=body),
                                    c.post(pair.decode_url + path, json=body))


def test_decode_refuses_requests_without_bootstrap_fields(pair):
    r = httpx.post(pair.decode_url + "/generate", json={"text": "hi"})
    assert r.status_code == 400
    assert "cannot prefill" in r.json()["error"]["message"]


def test_pair_matches_single_process_greedy_tokens(pair):
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=4096, context_length=1024))
    prompts = ["Hi", "What is disaggregated serving?", "long prompt spanning many pages " * 8]
    assert len(TOK.encode(prompts[-1])) > 10 * 16   # > window (16) and > 10 KV pages
    for text in prompts:
        body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
        p, d = asyncio.run(_both(pair, "/generate", body))
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert p.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        expected = generate_single_process(runner, TOK.encode(text), SamplingParams(max_new_tokens=24, temperature=0),
                                           EOS)
        assert d.json()["output_ids"] == expected
        assert d.json()["output_ids"][0] == p.json()["output_ids"][0]


def test_concurrent_requests_all_finish_and_free_their_pages(pair):
    async def run():
        bodies = [{"text": f"request {i}", "sampling_params": {"max_new_tokens": 16, "temperature": 0.7,
                                                                "sampling_seed": i}} for i in range(6)]
        return await asyncio.gather(*(_both(pair, "/generate", b) for b in bodies))

    for p, d in asyncio.run(run()):
        assert p.status_code == 200 and d.status_code == 200
    for url in (pair.prefill_url, pair.decode_url):
        assert httpx.get(url + "/server_info").json()["internal_states"][0]["num_used_tokens"] == 0


def test_chat_stream_from_decode_is_valid_sse(pair):
    async def run():
        body = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                **pair.bootstrap(secrets.randbits(63), "s1")}
        async with httpx.AsyncClient(timeout=60) as c:
            p = asyncio.create_task(c.post(pair.prefill_url + "/v1/chat/completions", json=body))
            async with c.stream("POST", pair.decode_url + "/v1/chat/completions", json=body) as d:
                lines = [line async for line in d.aiter_lines() if line]
            return await p, lines

    p, lines = asyncio.run(run())
    assert p.status_code == 200
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "error" not in chunks[0], chunks[0]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_decode_fails_cleanly_when_kv_never_arrives(pair):
    """Only the decode leg is sent: its KV never lands, so it answers 500 after its transfer timeout."""
    body = {"text": "orphan", "sampling_params": {"max_new_tokens": 4}, **pair.bootstrap(secrets.randbits(63), "o1")}
    r = httpx.post(pair.decode_url + "/generate", json=body, timeout=30)
    assert r.status_code == 500
    assert "did not arrive" in r.json()["error"]["message"]


def test_prefill_fails_cleanly_when_decode_never_reserves(pair):
    body = {"text": "lonely", **pair.bootstrap(secrets.randbits(63), "l1")}
    r = httpx.post(pair.prefill_url + "/generate", json=body, timeout=30)
    assert r.status_code == 500
    assert "decode never reserved KV" in r.json()["error"]["message"]
    assert httpx.get(pair.prefill_url + "/server_info").json()["internal_states"][0]["num_used_tokens"] == 0


def _used(url: str) -> int:
    return httpx.get(url + "/server_info").json()["internal_states"][0]["num_used_tokens"]


def test_abort_ends_a_running_stream_and_frees_its_pages(pair):
    before = _used(pair.decode_url)   # pages of earlier failed requests may still sit in quarantine

    async def run():
        body = {"text": "abort me", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
                **pair.bootstrap(secrets.randbits(63), "ab1")}
        async with httpx.AsyncClient(timeout=60) as c:
            p = asyncio.create_task(c.post(pair.prefill_url + "/generate", json=body))
            lines = []
            async with c.stream("POST", pair.decode_url + "/generate", json=body) as d:
                async for line in d.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:
                        await c.post(pair.decode_url + "/abort_request", json={"rid": "ab1"})
            return await p, lines

    p, lines = asyncio.run(run())
    assert p.status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["message"] == "aborted through /abort_request"
    assert len(lines) < 100
    assert _used(pair.decode_url) <= before


def test_metrics_use_sglang_names(pair):
    for url, engine_type in ((pair.prefill_url, "prefill"), (pair.decode_url, "decode")):
        text = httpx.get(url + "/metrics").text
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     "sglang:gen_throughput", "sglang:max_total_num_tokens", "sglang:num_used_tokens",
                     "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                     "sglang:time_to_first_token_seconds_bucket", "sglang:kv_transfer_latency_ms"):
            assert f"{name}{{" in text, name
        assert f'engine_type="{engine_type}"' in text


def test_mismatched_page_size_is_refused_with_a_reason(pair, tmp_path):
    port = free_port()
    log = tmp_path / "decode8.log"
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.workers.decode", "--host", "127.0.0.1",
                             "--port", str(port), "--page-size", "8", "--max-total-tokens", "2048",
                             "--context-length", "1024"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/health", [proc], [log])
        body = {"text": "x", **pair.bootstrap(secrets.randbits(63), "m1")}
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=30)
        assert r.status_code == 500
        assert "page_size" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(10)
