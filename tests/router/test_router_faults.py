"""Retries, the keep-alive race, the circuit breaker and the no-retry rules, against stub workers that misbehave
on purpose (`bench/stubs.py`: real sockets; the counts are what each stub received)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.settings import RouterSettings
from tests.router_fakes import MESSAGES, WAIT_S, FakeWorker, Rendezvous, router_settings
from tests.servers import StubThread, UvicornThread, bound_socket
from tests.helpers import SOON_S, metric, wait_for

TOKENS = "".join(f"t{i} " for i in range(8))


def stub(role: str, fault: str | None = None) -> StubThread:
    return StubThread(role, bound_socket(), fault)


def post(url: str, stream: bool) -> tuple[int, list[str] | dict]:
    body = {"messages": MESSAGES, "stream": stream}
    if not stream:
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)
        return resp.status_code, resp.json()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=WAIT_S) as resp:
        if not resp.headers["content-type"].startswith("text/event-stream"):
            resp.read()
            return resp.status_code, resp.json()
        return resp.status_code, [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def content(data: list[str]) -> str:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))



@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_the_first_byte_is_retried_on_a_fresh_pair(stream: bool) -> None:
    with stub("prefill") as p, stub("decode", "close") as dying, stub("decode") as good:
        settings = router_settings(p.url, dying.url, good.url, breaker_failures=100)
        with UvicornThread(build_app(settings)) as router:
            for _ in range(4):
                status, data = post(router.url, stream)
                assert status == 200
                assert content(data) == TOKENS if stream else data["choices"][0]["message"]["content"] == TOKENS
            assert dying.stats.generations == 2, "round robin sends every other first attempt to the dying decode"
            assert good.stats.generations == 4, "each request answered once, by the good decode"
            assert metric(router.url, "dsv4_router_retries_total") == 2
            assert metric(router.url, "dsv4_router_upstream_connection_errors_total") == 2


def test_no_retry_once_a_byte_was_sent_and_never_on_a_4xx() -> None:
    with stub("prefill") as p, stub("decode", "break") as breaking, stub("decode", "reject") as rejecting:
        settings = router_settings(p.url, breaking.url, rejecting.url, migration_limit=0, breaker_failures=100)
        with UvicornThread(build_app(settings)) as router:
            status, data = post(router.url, stream=True)  # round robin: decode-0 breaks mid-stream
            assert status == 200 and content(data) == "t0 t1 " and data[-1] == "[DONE]"
            assert "the decode worker" in json.loads(data[-2])["error"]["message"]
            assert (breaking.stats.generations, rejecting.stats.generations) == (1, 0), "not retried after bytes"
            status, data = post(router.url, stream=False)  # decode-1 answers 400
            assert status == 400 and data["error"]["message"] == "bad field"
            assert (breaking.stats.generations, rejecting.stats.generations) == (1, 1), "a 4xx is not retried"
            assert metric(router.url, "dsv4_router_retries_total") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_keep_alive_race_never_reaches_the_client(stream: bool) -> None:
    """The decode closes each keep-alive connection just as the next request arrives on it: every such request
    is lost on the wire, and the router must send it again on a fresh connection."""
    with stub("prefill") as p, stub("decode", "close_reused") as racy:
        with UvicornThread(build_app(router_settings(p.url, racy.url, breaker_failures=100))) as router:
            for _ in range(10):
                status, data = post(router.url, stream)
                assert status == 200
                assert content(data) == TOKENS if stream else data["choices"][0]["message"]["content"] == TOKENS
            lost = racy.stats.generations - 10
            assert lost >= 5, "most requests went out on a reused connection first (health probes open fresh ones)"
            assert metric(router.url, "dsv4_router_retries_total") == lost


def test_the_circuit_breaker_takes_a_refusing_worker_out() -> None:
    with stub("prefill") as p, stub("decode") as good:
        dead = f"http://127.0.0.1:{bound_socket().getsockname()[1]}"  # bound, never listening: refused
        settings = router_settings(p.url, dead, good.url, breaker_failures=2, breaker_cooldown_s=60, max_retries=1)
        with UvicornThread(build_app(settings)) as router:
            for _ in range(6):
                assert post(router.url, stream=False)[0] == 200
            assert metric(router.url, 'dsv4_router_worker_breaker_open{role="decode",worker="decode-0"}') == 1
            assert metric(router.url, "dsv4_router_upstream_connection_errors_total") == 2, \
                "after two refusals the breaker keeps requests away from it"
            assert good.stats.generations == 6
            assert httpx.get(router.url + "/health").json()["decode"] == {"eligible": 1, "configured": 2}


def test_least_load_avoids_the_worker_whose_kv_is_full() -> None:
    token = "admin-token-0123456789"
    with stub("prefill") as p, stub("decode") as busy, stub("decode") as idle:
        busy.stats.token_usage = 0.9  # what its /metrics reports as sglang:token_usage
        settings = router_settings(p.url, busy.url, idle.url, policy={"decode": "least_load"}, admin_token=token,
                                   health_check_interval_s=0.1)
        with UvicornThread(build_app(settings)) as router:
            def usage() -> float:
                workers = httpx.get(router.url + "/admin/workers", headers={"Authorization": f"Bearer {token}"}).json()
                return next(w["token_usage"] for w in workers["workers"] if w["name"] == "decode-0")

            wait_for(lambda: usage() == 0.9, SOON_S, "the health checks to read decode-0's KV usage")
            assert usage() == 0.9, "the health checks read the worker's reported KV usage"
            for _ in range(4):
                assert post(router.url, stream=False)[0] == 200
            assert (busy.stats.generations, idle.stats.generations) == (0, 4), "least_load avoids the loaded decode"


def test_a_prefill_failing_after_the_decodes_headers_is_retried_before_the_first_event() -> None:
    """SGLang's decode sends its 200 at once and its events once the KV arrived: a retryable failure of the prefill
    in between reaches the client as nothing at all, the request moves to a fresh pair."""
    with stub("prefill", "close") as dying, stub("prefill") as good, stub("decode", "headers_first") as d:
        raw = router_settings(dying.url, d.url, breaker_failures=100).model_dump()
        raw["prefill"].append({"name": "prefill-1", "url": good.url, "bootstrap_host": "127.0.0.1",
                               "bootstrap_port": 8999})
        settings = RouterSettings.model_validate(raw)
        with UvicornThread(build_app(settings)) as router:
            status, data = post(router.url, stream=True)
            assert status == 200 and content(data) == TOKENS and data[-1] == "[DONE]"
            assert (dying.stats.generations, good.stats.generations, d.stats.generations) == (1, 1, 2)
            assert metric(router.url, "dsv4_router_retries_total") == 1
        # stream_hold_s 0: no hold for the prefill's restart (it never comes: the stub passes its health checks)
        settings = settings.model_copy(update={"prefill": settings.prefill[:1], "max_retries": 1, "stream_hold_s": 0})
        with UvicornThread(build_app(settings)) as router:
            status, data = post(router.url, stream=True)
            assert status == 502, "nothing was streamed yet: a plain error response, not a 200 with an error event"
            assert "the prefill worker" in data["error"]["message"] and "prefill-0" not in data["error"]["message"]
            assert dying.stats.generations == 3, "two requests, the second retried once"
            # each attempt's decode leg goes out beside its prefill leg; one whose prefill failed first (the stub
            # closes at once) may be interrupted before it is sent, so the decode saw between none and both
            assert 2 <= d.stats.generations <= 4


def test_a_decode_failing_because_its_prefill_died_holds_the_request_instead_of_spending_its_retries() -> None:
    """The decode answers 500 (its KV bootstrap failed: the prefill died) before the router sees the prefill's
    connection close (50 ms later). The router lets the prefill leg show its fate before trying again, so it learns
    the prefill is gone and holds the request for its restart (`stream_hold_s`), instead of retrying on the dead
    prefill at once until `max_retries` ran out (a 502 under load in the outage test)."""
    with stub("prefill", "close_late") as p, stub("decode", "fail") as d:
        settings = router_settings(p.url, d.url, stream_hold_s=1.0, breaker_failures=100, health_check_interval_s=30)
        with UvicornThread(build_app(settings)) as router:
            asked = time.monotonic()
            status, _ = post(router.url, stream=False)
            held_s = time.monotonic() - asked
            assert status == 502                       # the prefill never came back: its error, once the hold ran out
            assert metric(router.url, "dsv4_router_retries_total") <= 1, "retried on the dead prefill at once"
            assert held_s >= 0.9, "held for the prefill's restart (stream_hold_s) before giving up"


def test_a_plain_request_whose_prefill_is_lost_after_the_decode_head_is_tried_again() -> None:
    """The decode sent a plain answer's status line (its body waits for the KV), then the prefill stopped answering
    its health checks mid-request. Nothing reached the client, so the request is held for the prefill's return and
    answered (it used to end in a 502: only a decode's own 5xx was tried again once D's head had arrived)."""
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet, mode="hold"), FakeWorker("decode", meet, mode="head_first")
    # P keeps the KV (and D waits for it) until the router ends the attempt, however slow the machine: with P's
    # default 3 s a loaded CI run let the first attempt finish before P left the pool ("ending the 0 requests it is
    # part of"), and no abort came
    prefill.hold_s = decode.hold_s = SOON_S
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url, stream_hold_s=20, health_check_interval_s=0.1,
                                   health_failures_to_unhealthy=1)
        with UvicornThread(build_app(settings)) as router:
            answer: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answer.append(httpx.post(
                router.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=2 * SOON_S)))
            client.start()
            wait_for(lambda: len(decode.received) == 1, SOON_S, "the decode leg to arrive")
            time.sleep(0.2)                   # its status line is out; the prefill holds the KV
            prefill.mode = "unhealthy"        # out of the pool: the router ends the request's attempt
            wait_for(lambda: len(decode.aborted) == 1, SOON_S, "the decode leg aborted")
            prefill.mode = "ok"               # back: the held request is tried again
            client.join(2 * SOON_S)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].json()["choices"][0]["message"]["content"] == "hello world"
    assert len(prefill.received) == 2 and len(decode.received) == 2
