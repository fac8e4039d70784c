"""A real embedded prefill and decode process pair, driven over HTTP as the router drives them."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time

import httpx
import pytest

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

from tests.helpers import SOON_S, kv_used, metric, wait_for, wait_for_async
from tests.servers import free_port
from tests.worker_procs import _wait, start_pair, stop_pair

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


def test_flash_pair_with_fp8_mixed_ratio_kv_matches_single_process(tmp_path):
    """The flash preset's layers (ratio 4, 128, 4, 128) and SGLang's fp8 pages, prefill -> NIXL -> decode in two
    processes on the CPU, equal one process (the prompt spans a ratio-128 entry and two 256-token pages)."""
    from dsv4_cluster.workers.engine.presets import model_config

    flags = ["--model-preset", "flash", "--page-size", "256", "--kv-cache-dtype", "fp8_e4m3", "--served-model-name",
             "dsv4-flash", "--stall-timeout-s", "120"]   # a full-size forward on a loaded 2-core CPU
    flash = start_pair(tmp_path, extra=flags, ready_timeout_s=120)
    try:
        text = "the ratio-128 entries of a long prompt " * 7
        assert len(TOK.encode(text)) > 256
        body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        p, d = asyncio.run(_both(flash, "/generate", body))
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        info = httpx.get(flash.decode_url + "/server_info", timeout=30).json()
    finally:
        stop_pair(flash)
    assert (info["kv_cache_dtype"], info["page_size"]) == ("fp8_e4m3", 256)
    runner = ModelRunner(RunnerConfig(model=model_config("flash"), page_size=256, max_total_tokens=4096,
                                      context_length=1024, kv_dtype="fp8_e4m3"))
    expected = generate_single_process(runner, TOK.encode(text), SamplingParams(max_new_tokens=8, temperature=0), EOS)
    assert d.json()["output_ids"] == expected


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


def _aborted_after_three_lines(pair, path: str, body: dict, rid: str) -> tuple[httpx.Response, list[str]]:
    """Both legs of a streamed request; the decode's aborted through /abort_request once 3 lines came. (P's
    answer, D's non-empty lines.)"""
    body = {**body, "stream": True, **pair.bootstrap(secrets.randbits(63), rid)}

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            p = asyncio.create_task(c.post(pair.prefill_url + path, json=body))
            lines = []
            async with c.stream("POST", pair.decode_url + path, json=body) as d:
                async for line in d.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:
                        await c.post(pair.decode_url + "/abort_request", json={"rid": rid})
            return await p, lines

    return asyncio.run(run())


def test_abort_ends_a_running_stream_and_frees_its_pages(pair):
    before = kv_used(pair.decode_url)   # pages of earlier failed requests may still sit in quarantine
    p, lines = _aborted_after_three_lines(
        pair, "/generate", {"text": "abort me", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}, "ab1")
    assert p.status_code == 200
    assert lines[-1] == "data: [DONE]"
    # as SGLang ends a request aborted through /abort_request: finished (no error), with the output so far
    last, before_last = json.loads(lines[-2][6:]), json.loads(lines[-3][6:])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted through /abort_request"}
    assert last["text"].startswith(before_last["text"]) and last["output_ids"][:2] == before_last["output_ids"][:2]
    assert len(lines) < 100
    assert kv_used(pair.decode_url) <= before


def test_an_aborted_chat_stream_ends_with_finish_reason_abort_as_sglangs(pair):
    """SGLang's chat stream after /abort_request: a chunk with finish_reason "abort" and the text so far, no error
    event (the openai client raises on one), then [DONE]."""
    body = {"messages": [{"role": "user", "content": "abort me"}], "max_tokens": 900, "ignore_eos": True}
    p, lines = _aborted_after_three_lines(pair, "/v1/chat/completions", body, "ab2")
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert p.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) < 100
    assert all("error" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["abort"]


def test_a_non_streaming_client_that_leaves_aborts_its_request(pair):
    """A non-streaming request whose client closes its connection (a router that died, a client timeout) is
    aborted as SGLang's server aborts it: the decode frees its KV at once instead of decoding 900 tokens for
    nobody."""
    before = kv_used(pair.decode_url)
    body = {"text": "nobody waits", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
            **pair.bootstrap(secrets.randbits(63), "left1")}

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            p = asyncio.create_task(c.post(pair.prefill_url + "/generate", json=body))
            with pytest.raises(httpx.ReadTimeout):
                await c.post(pair.decode_url + "/generate", json=body, timeout=httpx.Timeout(60, read=1.5))
            return await p

    assert asyncio.run(run()).status_code == 200
    left_at = time.monotonic()
    assert wait_for(lambda: kv_used(pair.decode_url) <= before, 3.0, "the left request's KV freed")
    running = httpx.get(pair.decode_url + "/server_info").json()["internal_states"][0]["num_running_reqs"]
    assert running == 0 and time.monotonic() - left_at < 3.0


def test_metrics_use_sglang_names(pair):
    for url, engine_type in ((pair.prefill_url, "prefill"), (pair.decode_url, "decode")):
        text = httpx.get(url + "/metrics").text
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     "sglang:gen_throughput", "sglang:max_total_num_tokens", "sglang:num_used_tokens",
                     "sglang:kv_available_tokens", "sglang:kv_evictable_tokens",
                     "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                     "sglang:time_to_first_token_seconds_bucket", "sglang:kv_transfer_latency_ms"):
            assert f"{name}{{" in text, name
        assert f'engine_type="{engine_type}"' in text


def test_a_plain_request_counts_in_ttft_and_itl_as_a_stream_does(pair):
    """SGLang's latency histograms are the engine's, not the transport's: a non-streaming request of n tokens adds
    one TTFT and n - 1 inter-token observations on the decode, as a streamed one does."""
    counts = ("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count")
    before = [metric(pair.decode_url, name) for name in counts]
    _, decode = pair.generate("plain timing", 6)
    assert decode.status_code == 200
    n = decode.json()["meta_info"]["completion_tokens"]
    after = [metric(pair.decode_url, name) for name in counts]
    assert n >= 2 and (after[0] - before[0], after[1] - before[1]) == (1, n - 1)


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


def test_decode_frees_a_given_up_room_at_once_when_prefill_never_wrote_it(pair):
    """Only the decode leg is sent and aborted: prefill confirms (/kv/cancel) that it never writes the room,
    so the pages come back at once, not at the quarantine's expiry (4 x the transfer timeout)."""
    before = kv_used(pair.decode_url)

    async def run():
        body = {"text": "given up", "sampling_params": {"max_new_tokens": 400},
                **pair.bootstrap(secrets.randbits(63), "gu1")}
        async with httpx.AsyncClient(timeout=30) as c:
            d = asyncio.create_task(c.post(pair.decode_url + "/generate", json=body))
            await wait_for_async(lambda: kv_used(pair.decode_url) != before, SOON_S, "the decode to take pages")
            await c.post(pair.decode_url + "/abort_request", json={"rid": "gu1"})
            return await d

    answer = asyncio.run(run())   # finished as SGLang finishes an aborted request: 200, finish_reason abort
    assert answer.status_code == 200 and answer.json()["output_ids"] == []
    assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
    # at once: well before the quarantine's expiry (4 x the pair's --transfer-timeout-s 3 = 12 s)
    assert wait_for(lambda: kv_used(pair.decode_url) <= before, 6.0, "the given-up room's pages freed")
    assert kv_used(pair.decode_url) == before




def _room_shared(pair, texts: tuple[str, str]) -> tuple[list[dict], int]:
    """Bodies of two greedy requests with one bootstrap_room, and the decode's KV now."""
    room = secrets.randbits(63)
    return [{"text": t, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
             **pair.bootstrap(room, f"shared-{room}-{i}")} for i, t in enumerate(texts)], kv_used(pair.decode_url)


def test_a_second_request_with_a_room_in_use_is_refused_and_the_first_runs_as_if_alone(pair):
    """Two requests with one bootstrap_room, both waiting on their KV: the decode kept only the later one under the
    room, so the first one waited forever (no deadline reached it) and the prefill's KV went to the later one. A
    room a live request holds is refused (400); the first request runs as if alone."""
    bodies, before = _room_shared(pair, ("room owner", "a later request that reuses the room"))

    async def run():
        async with httpx.AsyncClient(timeout=8) as c:
            d_first = asyncio.create_task(c.post(pair.decode_url + "/generate", json=bodies[0]))
            await wait_for_async(lambda: kv_used(pair.decode_url) > before, 5, "the first room reserved")
            d_later = await c.post(pair.decode_url + "/generate", json=bodies[1])
            p_first = await c.post(pair.prefill_url + "/generate", json=bodies[0])
            return await d_first, d_later, p_first

    d_first, d_later, p_first = asyncio.run(run())
    assert d_later.status_code == 400 and "in use" in d_later.json()["error"]["message"], d_later.text
    assert p_first.status_code == 200 and d_first.status_code == 200, (p_first.text, d_first.text)
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=4096, context_length=1024))
    params = SamplingParams(max_new_tokens=8, temperature=0)
    assert d_first.json()["output_ids"] == generate_single_process(runner, TOK.encode("room owner"), params, EOS)
    assert wait_for(lambda: kv_used(pair.decode_url) <= before, 5, "the decode's KV back to where it was")
    assert kv_used(pair.prefill_url) == 0


def test_kv_of_another_prompt_is_never_written_into_a_rooms_pages(pair):
    """The prefill got a different request under the room the decode reserved (the two sides saw two requests that
    share a room in opposite orders): its KV went into the decode's pages and the decode answered 200 with tokens of
    the wrong prompt. The reservation names its prompt (a digest): both legs fail instead, and free their KV."""
    bodies, before = _room_shared(pair, ("room owner", "room thief"))

    async def run():
        async with httpx.AsyncClient(timeout=8) as c:
            d = asyncio.create_task(c.post(pair.decode_url + "/generate", json=bodies[0]))
            await wait_for_async(lambda: kv_used(pair.decode_url) > before, 5, "the room reserved")
            return await c.post(pair.prefill_url + "/generate", json=bodies[1]), await d

    p, d = asyncio.run(run())
    assert (p.status_code, d.status_code) == (500, 500), (p.text, d.text)
    assert "another prompt" in p.json()["error"]["message"] and "another prompt" in d.json()["error"]["message"]
    assert wait_for(lambda: kv_used(pair.decode_url) <= before, 5, "the decode's KV back to where it was")
    assert kv_used(pair.prefill_url) == 0

def _greedy(pair, path: str, body: dict) -> dict:
    p, d = asyncio.run(_both(pair, path, body))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    return d.json()


def test_stop_strings_are_trimmed_through_the_pair_plain_and_streaming(pair):
    chat = {"messages": [{"role": "user", "content": "stop test"}], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    full = _greedy(pair, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    stop = full[10:13]
    cut = full.index(stop)
    plain = _greedy(pair, "/v1/chat/completions", {**chat, "stop": stop})["choices"][0]
    assert (plain["message"]["content"], plain["finish_reason"]) == (full[:cut], "stop")
    kept = _greedy(pair, "/v1/chat/completions", {**chat, "stop": stop, "no_stop_trim": True})
    assert kept["choices"][0]["message"]["content"] == full[:cut + len(stop)]

    async def stream():
        body = {**chat, "stop": [stop], "stream": True, **pair.bootstrap(secrets.randbits(63), "st1")}
        async with httpx.AsyncClient(timeout=60) as c:
            p = asyncio.create_task(c.post(pair.prefill_url + "/v1/chat/completions", json=body))
            async with c.stream("POST", pair.decode_url + "/v1/chat/completions", json=body) as d:
                lines = [line async for line in d.aiter_lines() if line.startswith("data: {")]
            return await p, [json.loads(line[6:]) for line in lines]

    p, chunks = asyncio.run(stream())
    assert p.status_code == 200
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(deltas) == full[:cut]                     # the stop string, sent over 3 tokens, never shows
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    generate = _greedy(pair, "/generate", {"text": "stop test", "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "ignore_eos": True}})
    gstop = generate["text"][5:7]
    trimmed = _greedy(pair, "/generate", {"text": "stop test", "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": gstop}})
    assert trimmed["text"] == generate["text"][:generate["text"].index(gstop)]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": gstop}


def test_openai_fields_over_http_neutral_accepted_others_refused_naming_the_field(pair):
    chat = {"messages": [{"role": "user", "content": "fields"}], "max_tokens": 3}
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "response_format": {"type": "text"}, "tools": None,
               "n": 1, "logprobs": False, "no_stop_trim": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
               "continue_final_message": False}
    _greedy(pair, "/v1/chat/completions", {**chat, **neutral})
    r = httpx.post(pair.decode_url + "/v1/chat/completions", json={**chat, "frequency_penalty": 0.7,
                                                                     **pair.bootstrap(1, "f1")}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("frequency_penalty: 0.7 is not supported: ")
    r = httpx.post(pair.decode_url + "/v1/completions", json={"prompt": "x", "echo": True,
                                                               **pair.bootstrap(2, "f2")}, timeout=30)
    assert r.status_code == 400 and "echo: true is not supported" in r.json()["error"]["message"]


def test_bodies_the_worker_cannot_read_get_a_400_in_the_envelope(pair):
    """Nesting past the JSON parser's stack once got starlette's plain-text 500, and a lone surrogate escape (valid
    JSON, no UTF-8 text) a 400 saying the body was not valid JSON. The nesting passes any recursion limit a worker
    process is likely to run under (Python's default is 1,000; this process's, should a test have raised it)."""
    depth = max(5000, 2 * sys.getrecursionlimit() + 100)
    deep = b'{"text": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
    surrogate = b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'
    for url in (pair.prefill_url, pair.decode_url):
        for raw, needle in ((deep, "nests arrays or objects too deeply"), (surrogate, "not valid Unicode text")):
            r = httpx.post(url + "/generate", content=raw, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"], r.text


def test_an_output_budget_past_the_context_is_refused_as_sglang_refuses_it(pair):
    """SGLang's TokenizerManager answers 400 when prompt + max_new_tokens exceeds context_length (1024 here); the
    embedded workers once cut the output at the context silently (200, finish_reason length)."""
    prompt = [65 + i % 26 for i in range(1000)]
    cases = [("/v1/completions", {"prompt": prompt, "max_tokens": 25}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1100}),
             ("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 25}})]
    for path, body in cases:
        for response in asyncio.run(_both(pair, path, body)):
            assert response.status_code == 400, (path, response.text)
            assert "exceeds the model's maximum context length of 1024 tokens" in response.json()["error"]["message"]
    done = _greedy(pair, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert done["usage"]["completion_tokens"] == 24 and done["choices"][0]["finish_reason"] == "length"


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_workers_use_almost_no_cpu_and_throughput_gauges_fall_to_zero(pair):
    _greedy(pair, "/generate", {"text": "warm", "sampling_params": {"max_new_tokens": 8}})
    before = [_cpu_seconds(p.pid) for p in pair.procs]
    time.sleep(6.0)     # longer than the gauges' 5-s window
    used = [(_cpu_seconds(p.pid) - b) / 6.0 for p, b in zip(pair.procs, before)]
    assert all(u < 0.05 for u in used), used          # NIXL's progress thread alone took ~0.66 of a core
    text = httpx.get(pair.decode_url + "/metrics").text
    gauge = next(line for line in text.splitlines() if line.startswith("sglang:gen_throughput{"))
    assert float(gauge.rsplit(" ", 1)[1]) == 0.0, gauge
