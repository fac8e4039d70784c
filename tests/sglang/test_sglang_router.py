"""SGLang's own Rust router (sglang-router 0.3.2, PD mode) in front of the embedded workers.

The router fills in SGLang's default request fields (`no_stop_trim`, `skip_special_tokens`,
`separate_reasoning`, `return_hidden_states`, ...), pairs a prefill with a decode, adds the bootstrap
fields and reads the prefill's answer fully: the workers must take all of it, as SGLang's servers do.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import httpx
import openai
import pytest

from tests.servers import free_ports
from tests.worker_procs import start_pair, stop_pair
from tests.helpers import wait_serving

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Through SGLang's router."}]


def _need_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("sglang-router is not installed; it is in the test extra (pip install -e '.[test]')")
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2)")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    _need_router()
    tmp = tmp_path_factory.mktemp("sglang-router")
    pair = start_pair(tmp)
    port, prometheus_port = free_ports(2)
    log = tmp / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
           "--port", str(port), "--prefill", pair.prefill_url, str(pair.bootstrap_port), "--decode",
           pair.decode_url, "--policy", "round_robin", "--worker-startup-timeout-secs", "60",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]   # its default port is fixed
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url + "/v1/models", 60, "sglang-router", proc, log.read_text)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stop_pair(pair)


@pytest.fixture()
def client(router):
    return openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_chat_through_sglangs_router(client):
    reply = client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert 1 <= len(reply.choices[0].message.content) <= 12   # one char per token; a sampled EOS shows none


def test_streaming_chat_through_sglangs_router_matches_the_plain_reply(client):
    plain = client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_through_sglangs_router(client):
    reply = client.completions.create(model="dsv4-tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and 1 <= len(reply.choices[0].text) <= 6


def test_generate_through_sglangs_router(router):
    r = httpx.post(router + "/generate", timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["output_ids"]) == 8 and body["meta_info"]["finish_reason"]["type"] == "length"
