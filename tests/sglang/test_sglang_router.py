"""SGLang's own Rust router in front of the embedded workers, PD mode: sglang-router 0.3.2 (its last release under
that name) and smg 1.13.0 (SGLang's gateway since), each run by its module (both install a `smg` script).

The router fills in SGLang's default request fields (`no_stop_trim`, `skip_special_tokens`,
`separate_reasoning`, `return_hidden_states`, ...), pairs a prefill with a decode, adds the bootstrap
fields and reads the prefill's answer fully: the workers must take all of it, as SGLang's servers do.
"""

from __future__ import annotations

import importlib.util
import os

import httpx
import openai
import pytest

from bench.common import process
from bench.router import anchor_argv, anchor_versions, stop_wait_s

from tests.servers import free_ports
from tests.worker_procs import start_pair, stop_pair
from tests.helpers import wait_serving

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Through SGLang's router."}]


GATEWAYS = {"sglang-router 0.3.2": ("sglang_router", "rust"), "smg 1.13.0": ("smg", "smg")}  # bench.router's names


def _need(package: str, pin: str) -> None:
    if importlib.util.find_spec(package) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{pin} is not installed; it is in the test extra (pip install -e '.[test]')")
        pytest.skip(f"{pin} is not installed (pip install {pin.replace(' ', '==')})")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = start_pair(tmp_path_factory.mktemp("sglang-gateways"))
    yield pair
    stop_pair(pair)


@pytest.fixture(scope="module")
def versions():
    """What each gateway says it is (asked once: `python -m smg --version` is a process)."""
    return anchor_versions()


@pytest.fixture(scope="module", params=list(GATEWAYS))
def router(request, pair, versions, tmp_path_factory):
    """The gateway as the benchmarks run it (`bench.router.anchor_argv`: by module, round robin both ways; stopped
    as they stop it), checked to be the release it is named for."""
    package, name = GATEWAYS[request.param]
    _need(package, request.param)
    assert versions[name] == request.param, versions
    port = free_ports(1)[0]
    log = tmp_path_factory.mktemp(package) / "router.log"
    cmd = anchor_argv(name, port, [(pair.prefill_url, pair.bootstrap_port)], [pair.decode_url]) + \
        ["--worker-startup-timeout-secs", "60"]
    url = f"http://127.0.0.1:{port}"
    with process(cmd, None, log, stop_s=stop_wait_s(name)) as proc:
        wait_serving(url + "/v1/models", 60, request.param, proc, log.read_text)
        yield url


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
