"""Admission (schema, model, size), API keys with the official `openai` client, and `/metrics`, against stub
workers on loopback: every rejected request must leave the workers untouched."""

from __future__ import annotations

import json
import math
import sys

import httpx
import openai
import pytest

from dsv4_cluster.router.app import build_app
from tests.helpers import wait_for
from tests.router_fakes import MESSAGES, WAIT_S, router_settings
from tests.servers import StubThread, UvicornThread, bound_socket

KEY = "sk-test-0123456789"
TOKENS = "".join(f"t{i} " for i in range(8))


class Router:
    def __init__(self, url: str, prefill: StubThread, decode: StubThread) -> None:
        self.url, self.prefill, self.decode = url, prefill, decode

    def untouched(self) -> bool:
        return self.prefill.stats.generations == 0 and self.decode.stats.generations == 0

    def post(self, body: dict, path: str = "/v1/chat/completions", key: str = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        return httpx.post(self.url + path, content=json.dumps(body).encode(), headers=headers, timeout=WAIT_S)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S)


@pytest.fixture(scope="module")
def router():
    with StubThread("prefill", bound_socket()) as p, StubThread("decode", bound_socket()) as d:
        settings = router_settings(p.url, d.url, api_keys=[KEY, "sk-second-key-000"], model_aliases=["tiny"],
                                   max_body_bytes=4096)
        with UvicornThread(build_app(settings)) as r:
            yield Router(r.url, p, d)


@pytest.fixture(autouse=True)
def reset_counts(router: Router) -> None:
    # Every accepted request reaches both stubs, but its prefill leg may land after the client had its answer (the
    # router sends both legs at once; a loaded machine can run the prefill task last): wait until the last test's
    # legs all arrived before counting from zero, so a late leg is never taken for a rejected request's.
    wait_for(lambda: router.prefill.stats.generations == router.decode.stats.generations, WAIT_S,
             "every accepted request's legs reached both stubs")
    for stub in (router.prefill, router.decode):
        stub.stats.generations = stub.stats.paired = 0


def test_openai_client_with_an_api_key(router: Router) -> None:
    reply = router.client().chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=8)
    assert reply.choices[0].message.content == TOKENS and reply.usage.completion_tokens == 8
    stream = router.client("sk-second-key-000").chat.completions.create(model="tiny", messages=MESSAGES,
                                                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == TOKENS
    assert [m.id for m in router.client().models.list().data] == ["dsv4-tiny", "tiny"]
    assert router.decode.stats.paired == 2 and router.prefill.stats.paired == 2


@pytest.mark.parametrize("key", ["sk-wrong-key", ""])
def test_a_wrong_or_missing_key_gets_401(router: Router, key: str) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        router.client(key or "none").chat.completions.create(model="dsv4-tiny", messages=MESSAGES)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert KEY not in str(err.value.body)
    with pytest.raises(openai.AuthenticationError):
        router.client(key or "none").models.list()
    assert httpx.post(router.url + "/generate", json={"text": "hi"}).status_code == 401
    assert router.untouched()


def test_an_unknown_model_gets_404_model_not_found(router: Router) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        router.client().chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "model_not_found" and "'gpt-4o'" in err.value.message
    assert router.untouched()


@pytest.mark.parametrize("fields, needle", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),  # SGLang's (0, 1], as the workers: the router once admitted 0
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 3}, "stop"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": "hi"}, "messages"),
    ({"model": 7}, "model"),
])
def test_bad_fields_get_400_naming_the_field(router: Router, fields: dict, needle: str) -> None:
    resp = router.post({"model": "dsv4-tiny", "messages": MESSAGES, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    assert router.untouched()


def test_generate_and_completions_are_checked_too(router: Router) -> None:
    resp = router.post({"text": "hi", "sampling_params": {"temperature": -1}}, path="/generate")
    assert resp.status_code == 400 and "sampling_params.temperature" in resp.json()["error"]["message"]
    resp = router.post({"prompt": {"a": 1}}, path="/v1/completions")
    assert resp.status_code == 400 and "prompt" in resp.json()["error"]["message"]
    assert router.untouched()
    assert router.post({"prompt": "hi", "max_tokens": 2, "extension_field": True}, path="/v1/completions").is_success


@pytest.mark.parametrize("kind, needle", [("nested", "too deeply"), ("digits", "too many digits")],
                         ids=["nested-too-deeply", "integer-with-too-many-digits"])
def test_a_body_the_json_parser_cannot_read_gets_400_not_500(kind: str, needle: str) -> None:
    """Nesting past the parser's recursion limit (RecursionError) and an integer over Python's digit limit
    (ValueError, not a JSONDecodeError) once fell through to the router's catch-all: a 500 for the client's fault.
    The nesting goes twice past this process's recursion limit (another test file in the same pytest worker may have
    raised it), so this router takes the default max_body_bytes; the digit limit is lowered to its minimum (640)
    while the test runs (process-wide: the router runs in this process)."""
    head = b'{"messages": [{"role": "user", "content": "hi"}], '
    depth = 2 * sys.getrecursionlimit() + 100
    raw = head + (b'"x": ' + b"[" * depth + b"]" * depth if kind == "nested" else b'"max_tokens": ' + b"9" * 700) + b"}"
    with StubThread("prefill", bound_socket()) as p, StubThread("decode", bound_socket()) as d:
        with UvicornThread(build_app(router_settings(p.url, d.url, api_keys=[KEY]))) as r:
            limit = sys.get_int_max_str_digits()
            sys.set_int_max_str_digits(640)
            try:
                resp = httpx.post(r.url + "/v1/chat/completions", content=raw, timeout=WAIT_S,
                                  headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
            finally:
                sys.set_int_max_str_digits(limit)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and needle in error["message"], error
            assert Router(r.url, p, d).untouched()


def test_a_body_over_max_body_bytes_gets_413(router: Router) -> None:
    resp = router.post({"messages": [{"role": "user", "content": "x" * 5000}]})
    assert resp.status_code == 413 and "max_body_bytes" in resp.json()["error"]["message"]
    chunks = iter([b'{"messages": [{"role": "user", "content": "', b"x" * 5000, b'"}]}'])
    resp = httpx.post(router.url + "/v1/chat/completions", content=chunks, timeout=WAIT_S,
                      headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert resp.status_code == 413, "chunked bodies are counted as they arrive"
    assert router.untouched()


def test_metrics_count_requests_latencies_and_workers(router: Router) -> None:
    router.client().chat.completions.create(model="dsv4-tiny", messages=MESSAGES)
    list(router.client().chat.completions.create(model="dsv4-tiny", messages=MESSAGES, stream=True))
    router.post({"messages": MESSAGES, "temperature": -1})
    text = httpx.get(router.url + "/metrics", timeout=WAIT_S).text
    for needle in ('dsv4_router_requests_total{route="/v1/chat/completions",status="200"}',
                   'dsv4_router_requests_total{route="/v1/chat/completions",status="400"}',
                   "dsv4_router_time_to_first_token_seconds_count", "dsv4_router_inter_token_latency_seconds_count",
                   'dsv4_router_e2e_request_latency_seconds_count{route="/v1/chat/completions"}',
                   'dsv4_router_worker_in_flight{role="decode",worker="decode-0"} 0.0',
                   'dsv4_router_worker_eligible{role="prefill",worker="prefill-0"} 1.0',
                   "dsv4_router_retries_total", "dsv4_router_migrations_total", "dsv4_router_pair_failures_total",
                   "dsv4_router_upstream_connection_errors_total", "dsv4_router_aborts_total"):
        assert needle in text, needle
    assert KEY not in text


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages.0"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": 5}, "stream_options"),
    ("/generate", {"text": "hi", "sampling_params": [3]}, "sampling_params.0"),
])
def test_a_400_names_the_field_and_no_python_class(router: Router, path: str, body: dict, field: str) -> None:
    """pydantic's "Input should be a valid dictionary or instance of Message" named the router's own model class."""
    resp = router.post(body, path=path)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == f"invalid request: {field}: Input should be a JSON object"
    assert router.untouched()


def test_a_rule_over_the_whole_body_is_stated_without_a_placeholder_field(router: Router) -> None:
    resp = router.post({"messages": MESSAGES, "top_logprobs": 2})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("invalid request: top_logprobs 2 needs logprobs: true")


@pytest.mark.parametrize("body, message", [
    ({"text": "hi", "top_logprobs_num": 21}, "top_logprobs_num: Input should be less than or equal to 20"),
    ({"text": "hi", "sampling_params": {"temperature": -1}},
     "sampling_params.temperature: Input should be greater than or equal to 0"),
    ({"text": 5}, "text: Input should be a valid string"),
    ({"text": "hi", "top_logprobs_num": [1, 21]}, "top_logprobs_num.1: Input should be less than or equal to 20"),
])
def test_a_400_on_a_value_or_list_field_names_only_the_form_the_client_sent(router: Router, body: dict,
                                                                             message: str) -> None:
    """/generate takes one value or a list of them (a batch): the error for a single value said also "Input should
    be a valid list" (seen by the docs review), as if a list were wanted."""
    resp = router.post(body, path="/generate")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == f"invalid request: {message}"
