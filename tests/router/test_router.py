"""The router against fake prefill/decode servers on real loopback ports (`router_fakes.py`)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from dsv4_cluster.router.__main__ import main as router_main
from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.pairing import ROOM_LIMIT
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.router.sse import DONE, Framer, events
from tests.router_fakes import LOGPROBS, MESSAGES, SSE, WAIT_S, Cluster, chat, router_settings
from tests.helpers import SOON_S, wait_for, wait_serving
from tests.servers import UvicornThread, free_port


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S * 2)


def stream_lines(url: str, path: str = "/v1/chat/completions", **body: Any) -> list[str]:
    with httpx.stream("POST", url + path, json={"messages": MESSAGES, **body, "stream": True}, timeout=WAIT_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(SSE)
        return [line.removeprefix("data: ") for line in r.iter_lines() if line]


def assert_paired(cluster: Cluster, path: str) -> dict:
    p, d = cluster.legs()
    assert p["path"] == d["path"] == path
    assert p["body"] == d["body"], "both legs get the same body"
    body = p["body"]
    assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == 8998
    assert isinstance(body["rid"], str) and len(body["rid"]) == 32
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < ROOM_LIMIT
    return body


def test_chat_plain_through_openai_client(cluster: Cluster) -> None:
    seen = set()
    for _ in range(3):
        cluster.reset()
        reply = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=4)
        assert reply.choices[0].message.content == "hello world"
        body = assert_paired(cluster, "/v1/chat/completions")
        assert body["messages"] == MESSAGES and body["max_tokens"] == 4
        seen.add((body["rid"], body["bootstrap_room"]))
    assert len({rid for rid, _ in seen}) == 3 and len({room for _, room in seen}) == 3, "fresh rid and room"


def test_a_served_request_leaves_no_reference_cycle_of_the_router(cluster: Cluster) -> None:
    """Every object a request made is freed by reference counting when it ends: a cycle per request (an attempt,
    its pair, the pair's callback back to the attempt) left ~13 objects a request to the garbage collector, whose
    older generations then took ~4% of the router's CPU under load."""
    cluster.reset()
    for stream in (False, True, False, True):   # a first round warms caches, imports, idle connections
        assert chat(cluster.router.url, stream=stream).status_code == 200
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        for stream in (False, True, False, True):
            assert chat(cluster.router.url, stream=stream).status_code == 200
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("dsv4_cluster.router")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == []


def test_chat_stream_through_openai_client_and_raw(cluster: Cluster) -> None:
    cluster.reset()
    stream = client(cluster).chat.completions.create(model="dsv4-tiny", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "tok0 tok1 "
    assert assert_paired(cluster, "/v1/chat/completions")["stream"] is True
    cluster.reset()
    data = stream_lines(cluster.router.url)
    assert data[-1] == "[DONE]" and len(data) == 4, "two tokens, the stop chunk and [DONE], nothing added"


def test_completions_and_generate_are_paired(cluster: Cluster) -> None:
    cluster.reset()
    assert client(cluster).completions.create(model="dsv4-tiny", prompt="hi", max_tokens=2).choices
    assert_paired(cluster, "/v1/completions")
    cluster.reset()
    assert httpx.post(cluster.router.url + "/generate", json={"text": "hi", "sampling_params": {}}).status_code == 200
    assert_paired(cluster, "/generate")
    cluster.reset()
    assert httpx.post(cluster.router.url + "/generate", json={"text": ["a", "b", "c"]}).status_code == 200
    body, decode = (leg["body"] for leg in cluster.legs())
    assert body == decode and body["bootstrap_host"] == ["127.0.0.1"] * 3 and body["bootstrap_port"] == [8998] * 3
    assert len(set(body["bootstrap_room"])) == 3 and all(0 <= r < ROOM_LIMIT for r in body["bootstrap_room"])
    assert len(set(body["rid"])) == 3, "a batch carries one rid and one room per item"


def test_generate_logprobs_put_prefill_first(cluster: Cluster) -> None:
    cluster.reset()
    want = LOGPROBS["prefill"] + LOGPROBS["decode"]
    body = {"text": "hi", "return_logprob": True}
    resp = httpx.post(cluster.router.url + "/generate", json=body, timeout=WAIT_S)
    assert resp.json()["meta_info"]["input_token_logprobs"] == want
    cluster.reset()
    data = stream_lines(cluster.router.url, "/generate", **body)
    assert data[-1] == "[DONE]" and len(data) == 4
    assert all(json.loads(d)["meta_info"]["input_token_logprobs"] == want for d in data[:-1])


def test_prefill_failure_returns_its_error_and_aborts_decode(cluster: Cluster) -> None:
    cluster.reset(prefill="fail", decode="slow")
    resp = chat(cluster.router.url)
    message = resp.json()["error"]["message"]
    # a worker's failure is the gateway's (502), named by role only: no worker name, no address, none of its words
    assert resp.status_code == 502 and "the prefill worker" in message and "KV transfer failed" not in message
    assert "prefill-0" not in message and resp.json()["error"]["type"] == "upstream_error"
    # nothing reached the client: a worker's 5xx is a failed attempt, tried on fresh pairs up to max_retries
    assert len(cluster.prefill.received) == 1 + cluster.settings.max_retries
    for leg in cluster.decode.received:
        assert cluster.decode.aborted_soon(leg["body"]["rid"])


def test_prefill_failure_mid_stream_ends_stream_with_error(cluster: Cluster) -> None:
    cluster.reset(prefill="fail_later", decode="slow")
    data = stream_lines(cluster.router.url)
    assert "tok0" in data[0] and data[-1] == "[DONE]"
    message = json.loads(data[-2])["error"]["message"]
    assert "the prefill worker" in message and "prefill-0" not in message
    assert cluster.decode.aborted_soon(cluster.legs()[1]["body"]["rid"])


def test_decode_error_is_passed_through_and_prefill_aborted(cluster: Cluster) -> None:
    cluster.reset(prefill="hold", decode="fail")
    resp = chat(cluster.router.url)                  # D's 503 in the OpenAI envelope, with Retry-After
    assert resp.status_code == 503 and "the decode worker cannot take" in resp.json()["error"]["message"]
    assert resp.headers["retry-after"] == "1" and "decode-0" not in resp.text
    # D answers at once, without waiting for P: the router may abort P's leg before P's server has read it
    # (its abort goes by rid all the same), so the rid is D's copy, not P's.
    assert len(cluster.decode.received) == 1
    assert cluster.prefill.aborted_soon(cluster.decode.received[0]["body"]["rid"])


@pytest.fixture(params=["own protocol", "uvicorn's protocol"])
def either(request, cluster: Cluster) -> Cluster:
    """The router as it serves (a lost connection is told by its protocol), and under another ASGI server (a task
    waits for `http.disconnect`)."""
    return cluster if request.param == "own protocol" else request.getfixturevalue("plain_cluster")


def test_client_disconnect_mid_stream_aborts_both_legs(either: Cluster) -> None:
    cluster = either
    cluster.reset(prefill="hold", decode="slow")
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "stream": True}, timeout=WAIT_S) as resp:
        assert "tok0" in next(resp.iter_lines())
    rid = cluster.legs()[0]["body"]["rid"]
    assert cluster.decode.aborted_soon(rid) and cluster.prefill.aborted_soon(rid)


def test_client_disconnect_while_waiting_aborts_both_legs(either: Cluster) -> None:
    cluster = either
    cluster.reset(prefill="hold", decode="ok")
    with pytest.raises(httpx.ReadTimeout):
        chat(cluster.router.url, timeout=0.2)
    time.sleep(0.05)
    rid = cluster.legs()[0]["body"]["rid"]
    assert cluster.decode.aborted_soon(rid) and cluster.prefill.aborted_soon(rid)


def test_models_and_health(cluster: Cluster) -> None:
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == ["dsv4-tiny"] and models.data[0].owned_by == "dsv4-cluster"
    health = httpx.get(cluster.router.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # unauthenticated: counts per role, never worker names (those are on the admin API)
    assert health.json()["prefill"] == {"eligible": 1, "configured": 1} == health.json()["decode"]
    assert "prefill-0" not in health.text and "decode-0" not in health.text


def test_browser_clients_get_sglangs_cors_and_models_carry_its_model_card(either: Cluster) -> None:
    """CORS as SGLang's server answers it: a preflight on a generation route, then a streamed POST with an Origin
    (its bytes unchanged) carry the allow headers; a request without an Origin gets none. /v1/models' entries carry
    SGLang's ModelCard fields (root, parent, max_model_len). Under both HTTP servers."""
    cluster, origin = either, {"Origin": "http://app.example"}
    cluster.reset()   # the test before it left the prefill holding (3 s a request)
    pre = httpx.options(cluster.router.url + "/v1/chat/completions",
                        headers={**origin, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    body = {"messages": MESSAGES, "stream": True}
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions", json=body, headers=origin,
                      timeout=WAIT_S) as resp:
        raw = resp.read()
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://app.example"
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions", json=body, timeout=WAIT_S) as plain:
        assert plain.read().count(b"data: ") == raw.count(b"data: ") and raw.endswith(b"data: [DONE]\n\n")
        assert "access-control-allow-origin" not in plain.headers
    card = httpx.get(cluster.router.url + "/v1/models").json()["data"][0]
    assert card["root"] == card["id"] == "dsv4-tiny" and card["parent"] is None
    assert card["max_model_len"] == 2048 == cluster.settings.context_length   # router_settings' context


def test_one_model_by_id_and_wrong_methods(cluster: Cluster) -> None:
    """OpenAI's retrieve-model through the official client; 405 (with Allow) for a known path's wrong method."""
    model = client(cluster).models.retrieve("dsv4-tiny")
    assert (model.id, model.object, model.owned_by) == ("dsv4-tiny", "model", "dsv4-cluster")
    with pytest.raises(openai.NotFoundError) as missing:
        client(cluster).models.retrieve("gpt-5")
    assert "The model 'gpt-5' does not exist" in str(missing.value) and missing.value.code == "model_not_found"
    for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/generate"), ("POST", "/v1/models")):
        r = httpx.request(method, cluster.router.url + path)
        assert r.status_code == 405, (method, path, r.text)
        assert r.json()["error"]["code"] == 405 and r.headers["allow"] in ("POST", "GET")


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b"null", "must be a JSON object, got null"),
    (b'{"model": "m"}', "'messages'"),
    (b'{"messages": [], "rid": "mine"}', "the router sets ['rid']"),
    (b'{"messages": [], "stream": "yes"}', "'stream' must be true or false, got \"yes\""),
    (b'{"messages": [], "stream": null}', "'stream' must be true or false, got null"),
])
def test_bad_requests_get_400(cluster: Cluster, content: bytes, needle: str) -> None:
    cluster.reset()
    resp = httpx.post(cluster.router.url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
    assert cluster.prefill.received == [] and cluster.decode.received == []


@pytest.mark.parametrize("dead, status, needle", [
    (True, 502, "the decode worker could not be reached"),
    (False, 504, "the decode worker did not answer within 0.5 s"),  # P holds, so D waits for KV
])
def test_dead_or_slow_worker_gives_502_or_504_and_aborts_the_legs(cluster: Cluster, dead, status, needle) -> None:
    decode = f"http://127.0.0.1:{free_port()}" if dead else cluster.settings.decode[0].url
    settings = router_settings(cluster.settings.prefill[0].url, decode, request_timeout_s=0.5, stream_hold_s=1,
                               breaker_failures=100)  # the breaker has its own test; held 1 s for a restart
    with UvicornThread(build_app(settings)) as router:
        for stream in (False, True):
            cluster.reset(prefill="hold")
            resp = chat(router.url, stream=stream)
            message = resp.json()["error"]["message"]
            assert resp.status_code == status and needle in message and decode not in message, "no internal URL"
            assert cluster.prefill.aborted_soon()  # its request may be cancelled before it was sent
            assert wait_for(lambda: all(json.dumps(leg["body"]["rid"]) in cluster.prefill.ever_aborted
                                        for leg in cluster.prefill.received), SOON_S, "every attempt's P aborted")
            assert dead or cluster.decode.aborted_soon(cluster.decode.received[0]["body"]["rid"])


def test_router_without_workers_is_unhealthy_and_refuses() -> None:
    with UvicornThread(build_app(RouterSettings(model_name="m"))) as router:
        assert httpx.get(router.url + "/health").status_code == 503
        resp = chat(router.url)
        assert resp.status_code == 503 and "no prefill worker" in resp.json()["error"]["message"]


def test_sse_events_are_reframed_across_chunk_boundaries() -> None:
    framer = Framer()
    got = [framer.feed(piece) for piece in (b'data: {"a"', b": 1}\r", b"\n\r\ndata: [DO", b"NE]\n\n")]
    assert got == [b"", b"", b'data: {"a": 1}\n\n', DONE] and framer.feed(b"data: cut") == b""
    run = framer.feed(b" off\n\ndata: 2\n\n\n\ndata: 3\n")     # everything up to the last boundary, as one run
    assert run == b"data: cut off\n\ndata: 2\n\n\n\n" and events(run) == [b"data: cut off\n\n", b"data: 2\n\n"]
    assert framer.feed(b"\n") == b"data: 3\n\n" and framer.feed(b"\n\n") == b""


def test_cli_rejects_bad_settings_with_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model_name": "m", "decode": [{"name": "d", "url": "localhost:1"}], "prot": 1}))
    assert router_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "decode.0.url" in err and "prot" in err
    assert router_main(["--config", str(tmp_path / "missing.json")]) == 2


def test_cli_serves_the_settings_file(cluster: Cluster, tmp_path) -> None:
    port = free_port("127.0.0.1")
    path = tmp_path / "router.json"
    path.write_text(cluster.settings.model_copy(update={"port": 1}).model_dump_json())
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.router", "--config", str(path),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(f"http://127.0.0.1:{port}/health", 60, "the router", proc)  # a loaded machine imports slowly
        cluster.reset()
        resp = chat(f"http://127.0.0.1:{port}")
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hello world"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert f"serving on http://127.0.0.1:{port}" in out

