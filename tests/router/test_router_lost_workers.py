"""A worker lost while a request is in flight (killed, stopped, restarted by its supervisor), against fake workers
(`tests/router_fakes.py`) whose health and failures the tests flip: a prefill lost after its KV went out ends
nothing, one lost during its prefill is a failed attempt like any other, and a decode that fails its health checks
mid-stream is continued on a fresh pair as a crashed one is."""

from __future__ import annotations

import json
import threading
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import httpx
import pytest

from dsv4_cluster.router.app import build_app
from tests.helpers import SOON_S, metric, wait_for
from tests.router_fakes import MESSAGES, FakeWorker, Rendezvous, router_settings
from tests.servers import UvicornThread

FAST_CHECKS = {"health_check_interval_s": 0.1, "health_failures_to_unhealthy": 1}


@contextmanager
def router(prefill: FakeWorker, *decodes: FakeWorker, **settings: Any) -> Iterator[str]:
    """The router's URL, in front of `prefill` and `decodes` (round robin: the first request goes to decodes[0])."""
    with ExitStack() as stack:
        p, *ds = (stack.enter_context(UvicornThread(w.app())) for w in (prefill, *decodes))
        app = build_app(router_settings(p.url, *(d.url for d in ds), **{**FAST_CHECKS, **settings}))
        yield stack.enter_context(UvicornThread(app)).url


def eligible(url: str, role: str) -> int:
    return httpx.get(url + "/health", timeout=SOON_S).json()[role]["eligible"]



def read_stream(url: str, after: int = 0, then=None) -> tuple[str, list[dict], list[str]]:
    """A streamed chat request: its text, its error events, and its data lines; `then()` is called once `after`
    content events arrived (the stream is read on while it runs)."""
    text, errors, lines, events = "", [], [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": MESSAGES, "stream": True},
                      timeout=SOON_S) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                text += piece
                events += 1
                if events == after and then is not None:
                    then()
    return text, errors, lines


def tokens(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


@pytest.mark.parametrize("how", ["health checks", "connection dropped"])
def test_a_stream_goes_on_when_its_prefill_is_lost_after_the_kv_went_out(how: str) -> None:
    """The prefill answered (or, its connection dropped, the decode already streams: the KV is there) before it was
    lost: the stream goes on to its end. It used to end with "the prefill worker stopped answering while serving
    this request" (health checks), or "... dropped the connection" (a prefill killed before its answer ended)."""
    meet = Rendezvous()
    prefill = FakeWorker("prefill", meet, mode="ok" if how == "health checks" else "drop_after_kv")
    decode = FakeWorker("decode", meet, mode="slow", tokens=30)

    def lose_prefill() -> None:
        if how == "health checks":
            prefill.mode = "unhealthy"
            wait_for(lambda: eligible(url, "prefill") == 0, SOON_S, "the prefill out of the pool")
        else:
            rid = prefill.received[0]["body"]["rid"]
            meet("drop", rid).set()
            wait_for(meet("dropped", rid).is_set, SOON_S, "the prefill's connection dropped")

    with router(prefill, decode, stream_hold_s=0) as url:
        text, errors, lines = read_stream(url, after=3, then=lose_prefill)
    assert errors == [] and text == tokens(30) and lines[-1] == "[DONE]"
    assert len(prefill.received) == len(decode.received) == 1 and decode.aborted == []


def test_a_plain_request_whose_prefill_is_lost_after_it_answered_is_not_redone() -> None:
    """The prefill answered (the KV is at the decode), then failed its health checks while the decode still worked:
    the decode's answer is the client's. It used to be aborted and the request done again from scratch."""
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet, mode="answer_late", hold_s=SOON_S)
    answers: list[httpx.Response] = []
    with router(prefill, decode, stream_hold_s=SOON_S) as url:
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=2 * SOON_S)))
        client.start()
        wait_for(lambda: decode.received, SOON_S, "the decode leg")
        rid = decode.received[0]["body"]["rid"]
        wait_for(lambda: meet("kv_sent", rid).is_set(), SOON_S, "the prefill's answer")
        prefill.mode = "unhealthy"
        wait_for(lambda: eligible(url, "prefill") == 0, SOON_S, "the prefill out of the pool")
        prefill.mode = "ok"
        wait_for(lambda: eligible(url, "prefill") == 1, SOON_S, "the prefill back")
        decode.hold_s = 0                         # the decode answers now (and at once, a request done again)
        meet("never", rid).set()
        client.join(2 * SOON_S)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["choices"][0]["message"]["content"] == "hello world"
    assert len(prefill.received) == len(decode.received) == 1 and decode.aborted == [], "done once"


@pytest.mark.parametrize("decode_mode", ["head_first", "ok"])
def test_a_stream_whose_prefill_dies_during_its_prefill_is_tried_again(decode_mode: str) -> None:
    """The prefill leg is a stream too: its 200 came before its work, then its connection dropped (the process was
    killed mid-prefill) while nothing reached the client. The request is held for the prefill's return and served
    (it was a 502 "the prefill worker dropped the connection", while plain requests were held). The decode's head
    came at once (SGLang's, "head_first") or waits for the KV."""
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet, mode="die_once"), FakeWorker("decode", meet, mode=decode_mode)
    with router(prefill, decode, stream_hold_s=SOON_S, max_retries=0) as url:
        text, errors, lines = read_stream(url)
        holds = metric(url, "dsv4_router_stream_hold_tries_total", SOON_S)
    assert errors == [] and lines[-1] == "[DONE]"
    assert text == (tokens(1) if decode_mode == "head_first" else tokens(2))
    assert len(prefill.received) == 2, "one try that died, one that answered"
    assert holds == 1, "the dead prefill's request was held for it (max_retries 0: never retried at once)"


@pytest.mark.parametrize("case", ["another decode", "the same decode back", "no migration budget"])
def test_a_stream_whose_decode_fails_its_health_checks_is_continued_on_a_fresh_pair(case: str) -> None:
    """The decode stops answering its health checks mid-stream (SIGTERM: it stops accepting, its streams run on for
    a while): the stream is continued from what the client has, as one whose decode crashed, on another decode or
    on the same one once it is back (held, `stream_hold_s`), within `migration_limit`. It used to end with "the
    decode worker stopped answering while serving this request"."""
    meet = Rendezvous()
    lost = FakeWorker("decode", meet, mode="slow", tokens=100)
    decodes = [lost, FakeWorker("decode", meet)] if case == "another decode" else [lost]
    prefill = FakeWorker("prefill", meet)

    def lose_decode() -> None:
        lost.mode = "unhealthy"
        wait_for(lambda: eligible(url, "decode") == len(decodes) - 1, SOON_S, "the decode out of the pool")
        if case == "the same decode back":
            lost.mode = "ok"

    with router(prefill, *decodes, stream_hold_s=SOON_S, migration_limit=0 if case == "no migration budget" else 1) \
            as url:
        text, errors, lines = read_stream(url, after=3, then=lose_decode)
        migrations = metric(url, "dsv4_router_migrations_total", SOON_S)
    assert lines[-1] == "[DONE]" and lost.aborted_soon(lost.received[0]["body"]["rid"])
    if case == "no migration budget":
        assert [e["message"] for e in errors] == ["the decode worker stopped answering while serving this request"]
        assert migrations == 0 and len(lost.received) == 1
        return
    assert errors == [] and migrations == 1
    resumed = decodes[-1].received[-1]["body"]
    assert len(prefill.received) == 2 and resumed["continue_final_message"] is True
    seam = resumed["messages"][-1]
    assert seam["role"] == "assistant" and seam["content"].startswith(tokens(3)) and len(seam["content"]) < 400
    assert text == seam["content"] + tokens(2), "the continuation goes on from the text the client has"
