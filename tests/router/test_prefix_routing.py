"""Two prefill and two decode embedded workers (real processes, KV over NIXL) behind the router with the `prefix`
policy for prefill and `least_load` for decode: multi-turn sessions sharing a system prompt stay on the prefill
that has their history, so every turn after the first finds its KV in that prefill's cache (usage and both
prefills' metrics say how much), and every answer equals a single-process run without any cache."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.settings import RouterSettings
from tests.servers import UvicornThread
from tests.worker_procs import start_pair, stop_pair
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

pytestmark = pytest.mark.slow
TOK = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are the tiny test model; answer briefly. " * 3}
TURNS = ("Hello", "Tell me about pages", "And about caches")
FILLER = "I would like a short answer about the tiny model, please, and about its pages. "   # whole blocks per turn
PAGE = 16                                       # the embedded workers' page size (their default)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    started = []
    try:
        for i in range(2):
            started.append(start_pair(tmp_path_factory.mktemp(f"pair{i}")))
        yield started
    finally:
        for p in started:
            stop_pair(p)


def _settings(pairs, policy: str = "prefix") -> RouterSettings:
    return RouterSettings(
        host="127.0.0.1", port=1, model_name="dsv4-tiny", request_timeout_s=60, health_check_interval_s=0.5,
        policy={"prefill": policy, "decode": "least_load", "prefix": {"chars_per_token": 1}},   # a byte tokenizer
        prefill=[{"name": f"prefill-{i}", "url": p.prefill_url, "bootstrap_host": "127.0.0.1",
                  "bootstrap_port": p.bootstrap_port} for i, p in enumerate(pairs)],
        decode=[{"name": f"decode-{i}", "url": p.decode_url} for i, p in enumerate(pairs)])


def _cached_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^sglang:cached_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_sessions_stay_on_their_prefill_and_hit_its_cache(pairs):
    """Each turn after the first finds the whole previous turn in its prefill's cache (all its whole pages), which
    only the prefill that served that turn has: under round robin the sessions change prefill every turn here and
    find the system prompt at most."""
    plain = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=PAGE, max_total_tokens=4096, context_length=1024))
    with UvicornThread(build_app(_settings(pairs))) as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        cached, prompts = [], []
        histories = [[SYSTEM] for _ in range(3)]
        for turn in TURNS:                          # the sessions interleave, turn by turn
            for s, history in enumerate(histories):
                history.append({"role": "user", "content": f"session {s}: {turn}. " + FILLER})
                reply = client.chat.completions.create(model="dsv4-tiny", messages=history, max_tokens=12,
                                                       temperature=0)
                expected = generate_single_process(plain, TOK.apply_chat_template(history),
                                                   SamplingParams(max_new_tokens=12, temperature=0), EOS)
                assert reply.choices[0].message.content == TOK.decode(
                    [t for t in expected if t != EOS]), "the cache changes no answer"
                cached.append(reply.usage.prompt_tokens_details.cached_tokens)
                prompts.append(reply.usage.prompt_tokens)
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
        sessions = len(histories)
        for i in range(sessions, len(cached)):      # the session's previous turn: every whole page of its prompt
            assert cached[i] >= prompts[i - sessions] // PAGE * PAGE - PAGE, (i, cached, prompts)
        assert sum(cached) == sum(_cached_total(p.prefill_url) for p in pairs)
