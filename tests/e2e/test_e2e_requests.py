"""Requests through a whole cluster (`dsv4-cluster up`): router -> prefill -> NIXL -> decode.

The oracle: greedy tokens through the cluster equal those of a single-process run of the same
engine, including a prompt longer than the sliding window that spans many KV pages.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

pytestmark = pytest.mark.slow
TOK = ByteTokenizer()
MESSAGES = [{"role": "user", "content": "Say something about KV caches."}]


@pytest.fixture(scope="module")
def cluster(local_cluster):
    with local_cluster("cluster", context_length=1024, kernels=True) as c:
        yield c


@pytest.fixture()
def client(cluster):
    return openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_chat_completion_with_the_openai_client(client):
    reply = client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert 1 <= len(reply.choices[0].message.content) <= 12   # one char per token; an EOS shows no text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(TOK.apply_chat_template(MESSAGES)), 12)


def test_streaming_with_the_openai_client_matches_the_plain_reply(client):
    plain = client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content


def test_raw_sse_ends_with_done(cluster):
    body = {"model": "dsv4-tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", cluster.router_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line.removeprefix("data: "))["object"] == "chat.completion.chunk"


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["dsv4-tiny"]


def test_greedy_tokens_through_the_cluster_equal_a_single_process_run(cluster):
    runner = ModelRunner(RunnerConfig(model=ModelConfig(seed=0), page_size=16, max_total_tokens=4096,
                                      context_length=1024))
    prompts = ["Hello", "Prefill and decode run in separate processes.",
               "a prompt longer than the sliding window, spanning many KV pages; " * 5]
    assert len(TOK.encode(prompts[-1])) > 16 * 16
    for text in prompts:
        r = httpx.post(cluster.router_url + "/generate", timeout=120,
                       json={"text": text, "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
        assert r.status_code == 200, r.text
        expected = generate_single_process(runner, TOK.encode(text), SamplingParams(max_new_tokens=32, temperature=0),
                                           EOS)
        assert r.json()["output_ids"] == expected, text


def test_status_reports_kernels_and_kv(cluster):
    status = json.loads(cluster.cli("status", "--json").stdout)
    workers = {w["name"]: w for w in status["workers"]}
    assert workers["prefill-0"]["kv_capacity_tokens"] == 4096
    info = httpx.get(f"http://127.0.0.1:{cluster.ports['decode']}/server_info").json()
    assert info["kernels"] == {"sparse_mla_decode": "reference", "indexer": "reference", "topk": "reference"}
