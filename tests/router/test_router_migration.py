"""Stream migration on the embedded engine: SIGKILL the decode mid-stream with a second decode in the pool; the
client's greedy stream completes and equals an uninterrupted run, token for token, with the right usage."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from dsv4_cluster.router.app import build_app
from tests.router_fakes import router_settings
from tests.servers import UvicornThread, free_port
from tests.worker_procs import WorkerPair, _wait, start_pair, stop_pair

ARGS = ["--host", "127.0.0.1", "--max-total-tokens", "4096", "--context-length", "1024"]
BODY = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "x"}],
        "stream": True, "temperature": 0, "max_tokens": 40, "logprobs": True, "top_logprobs": 2,
        "stream_options": {"include_usage": True}}
# No ignore_eos: an EOS in mid-stream would stream as no text, and text is what a continuation is built from.
# The seeded tiny model answers this prompt with 40 printable tokens and no EOS.


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    port = free_port()
    log = tmp / "decode-1.log"
    second = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.workers.decode", "--port", str(port), *ARGS],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)  # boots beside the pair
    try:
        pair = start_pair(tmp)
    except BaseException:
        second.kill()
        second.wait()
        raise
    pair.procs.append(second)
    pair.logs.append(log)
    try:
        _wait(f"http://127.0.0.1:{port}/health", pair.procs, pair.logs, timeout_s=180)
        yield pair, f"http://127.0.0.1:{port}"
    finally:
        stop_pair(pair)


def stream(url: str, kill_after: int | None = None, victim: subprocess.Popen | None = None,
           after_kill=None) -> tuple[str, dict, int]:
    """The streamed text, the usage chunk, and how many content events arrived; SIGKILLs `victim` after
    `kill_after` content events (then calls `after_kill`). Each token's logprob entry goes to LOGPROBS[url]."""
    text, usage, events, done = "", {}, 0, False
    entries = LOGPROBS[url] = []
    seam = SEAM[url] = {"id": set(), "created": set(), "roles": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            seam["id"].add(chunk["id"])
            seam["created"].add(chunk["created"])
            for choice in chunk.get("choices", []):
                seam["roles"] += "role" in choice["delta"]
                entries += (choice.get("logprobs") or {}).get("content") or []
                if choice["delta"].get("content"):
                    text += choice["delta"]["content"]
                    events += 1
                    if events == kill_after:
                        os.kill(victim.pid, signal.SIGKILL)
                        if after_kill is not None:
                            after_kill()
        assert done
    return text, usage, events


LOGPROBS: dict[str, list] = {}
SEAM: dict[str, dict] = {}   # per router: the stream's ids, created times and role chunks


def assert_one_stream(url: str) -> None:
    """The seam does not show: one id, one created time, one role chunk, as in an uninterrupted stream."""
    seam = SEAM[url]
    assert (len(seam["id"]), len(seam["created"]), seam["roles"]) == (1, 1, 1), seam


def prefill_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_requests_total"))


def assert_same_logprobs(got: list, want: list) -> None:
    """Token for token the same tokens and alternatives, logprobs equal within the float32 rounding a prefix
    cache hit may change (tests/router/test_logprobs.py)."""
    assert len(got) == len(want) == 40
    for g, w in zip(got, want):
        assert g["token"] == w["token"] and abs(g["logprob"] - w["logprob"]) < 1e-4, (g, w)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]], (g, w)


def test_a_greedy_stream_survives_a_decode_sigkill(workers: tuple[WorkerPair, str]) -> None:
    pair, second = workers
    settings = router_settings(pair.prefill_url, pair.decode_url, second, migration_limit=1,
                               health_check_interval_s=0.2, health_check_timeout_s=10)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": pair.bootstrap_port})]})
    with UvicornThread(build_app(settings)) as router:
        baseline, usage, events = stream(router.url)  # round robin: decode-0
        assert events == 40 and usage["completion_tokens"] == 40, (baseline, usage)
        want = LOGPROBS[router.url]
        again, _, _ = stream(router.url)  # decode-1 gives the same greedy text
        assert again == baseline
        victim = pair.procs[1]  # decode-0, serving the next stream
        migrated, migrated_usage, _ = stream(router.url, kill_after=12, victim=victim)
        assert victim.wait(10) == -signal.SIGKILL
        assert migrated == baseline, "the continued stream equals the uninterrupted one, token for token"
        assert_same_logprobs(LOGPROBS[router.url], want)  # the spliced stream's logprobs too
        assert migrated_usage == usage, "usage counts the migrated tokens as completion, not prompt"
        assert_one_stream(router.url)
        metrics = httpx.get(router.url + "/metrics").text
        assert "dsv4_router_migrations_total 1.0" in metrics


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    pair = start_pair(tmp_path_factory.mktemp("hold"))
    try:
        yield pair
    finally:
        stop_pair(pair)


def test_with_the_only_decode_killed_the_stream_is_held_and_resumed_on_its_restart(single: WorkerPair) -> None:
    """The production topology has one decode: kill -9 it mid-stream, start it again as its supervisor would
    (same port, same NIXL agent name); the router holds the stream (stream_hold_s) and continues it there. The
    client's greedy stream equals the uninterrupted one, token for token, usage included."""
    import threading

    from tests.worker_procs import restart

    settings = router_settings(single.prefill_url, single.decode_url, migration_limit=1, stream_hold_s=30,
                               health_check_interval_s=0.2, health_check_timeout_s=10, breaker_cooldown_s=0.5)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": single.bootstrap_port})]})
    with UvicornThread(build_app(settings)) as router:
        baseline, usage, events = stream(router.url)
        assert events == 40 and usage["completion_tokens"] == 40, (baseline, usage)
        want = LOGPROBS[router.url]
        victim = single.procs[1]
        restarter = threading.Thread(target=restart, args=(single, 1))   # waits for the death, starts it again
        legs = prefill_requests(single.prefill_url)
        began = time.monotonic()
        try:
            held, held_usage, _ = stream(router.url, kill_after=12, victim=victim, after_kill=restarter.start)
        finally:
            if restarter.is_alive() or restarter.ident is not None:
                restarter.join(120)
        assert victim.poll() == -signal.SIGKILL and single.procs[1] is not victim
        assert held == baseline, "the held stream, continued on the restarted decode, equals the uninterrupted one"
        assert_same_logprobs(LOGPROBS[router.url], want)
        # cached_tokens too: the first attempt's, not the continuation's (whose prompt that attempt had cached)
        assert held_usage == usage, (held_usage, usage)
        assert_one_stream(router.url)
        metrics = httpx.get(router.url + "/metrics").text
        assert "dsv4_router_migrations_total 1.0" in metrics
        holds = float(next(line.split()[-1] for line in metrics.splitlines()
                           if line.startswith("dsv4_router_stream_hold_tries_total")))
        assert holds >= 1, "the stream waited for the restart: no decode was there at first"
        legs = prefill_requests(single.prefill_url) - legs - 1   # the prefill legs the held stream's tries sent
        assert legs == holds <= time.monotonic() - began, "at most one try (one prefill leg) a second while held"
        again, _, _ = stream(router.url)                      # and the restarted decode serves on
        assert again == baseline


def _route_stream(url: str, path: str, body: dict, kill_after: int | None = None, victim=None, after_kill=None) -> dict:
    """A streamed completions or /generate answer as the client saw it: text, ids, created times, usage / meta."""
    seen = {"text": "", "ids": set(), "created": set(), "usage": None, "meta": None, "output_ids": None}
    events, last = 0, ""
    with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            last = line or last
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if path == "/generate":
                seen.update(text=chunk["text"], output_ids=chunk["output_ids"], meta=chunk["meta_info"])
                seen["ids"].add(chunk["meta_info"]["id"])
            else:
                seen["ids"].add(chunk["id"])
                seen["created"].add(chunk["created"])
                seen["usage"] = chunk.get("usage") or seen["usage"]
                seen["text"] += "".join(c["text"] for c in chunk["choices"])
            events += 1
            if events == kill_after:
                os.kill(victim.pid, signal.SIGKILL)
                after_kill()
        assert last == "data: [DONE]"
    return seen


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_resumed_stream_with_a_stop_string_in_its_resumed_part_equals_the_uninterrupted_one(
        single: WorkerPair, path: str) -> None:
    """Completions and /generate held across the only decode's restart: the client's text (cut at a stop string that
    comes after the seam), token count, usage and id are those of the uninterrupted run."""
    import threading

    from tests.worker_procs import restart

    settings = router_settings(single.prefill_url, single.decode_url, migration_limit=1, stream_hold_s=30,
                               health_check_interval_s=0.2, health_check_timeout_s=10, breaker_cooldown_s=0.5)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": single.bootstrap_port})]})
    params = {"temperature": 0, "max_new_tokens" if path == "/generate" else "max_tokens": 150}   # ~0.8 s here
    # the seeded tiny model answers "y" with 181 printable tokens, then EOS
    body = {"text": "y", "sampling_params": params, "stream": True} if path == "/generate" else \
        {"model": "dsv4-tiny", "prompt": "y", "stream": True, "stream_options": {"include_usage": True}, **params}
    with UvicornThread(build_app(settings)) as router:
        whole = _route_stream(router.url, path, body)["text"]
        stop = whole[100:103]
        assert len(whole) == 150 and whole.find(stop) >= 20, whole   # the stop string comes after the seam
        with_stop = copy.deepcopy(body)
        (with_stop["sampling_params"] if path == "/generate" else with_stop)["stop"] = [stop]
        baseline = _route_stream(router.url, path, with_stop)
        assert baseline["text"] == whole[:whole.find(stop)]
        victim = single.procs[1]
        restarter = threading.Thread(target=restart, args=(single, 1))
        try:
            resumed = _route_stream(router.url, path, with_stop, kill_after=10, victim=victim,
                                    after_kill=restarter.start)
        finally:
            if restarter.ident is not None:
                restarter.join(120)
        assert victim.poll() == -signal.SIGKILL
        assert resumed["text"] == baseline["text"] and len(resumed["ids"]) == 1
        if path == "/generate":
            assert resumed["output_ids"] == baseline["output_ids"]
            keys = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason")
            assert {k: resumed["meta"][k] for k in keys} == {k: baseline["meta"][k] for k in keys}
        else:
            assert resumed["usage"] == baseline["usage"] and len(resumed["created"]) == 1
        assert "dsv4_router_migrations_total 1.0" in httpx.get(router.url + "/metrics").text, "it was resumed"
