"""Requests held across the restart of the only prefill (router/generation.py, `Flight.hold`), on the embedded
engine: real prefill and decode processes, the prefill SIGKILLed while 8 plain requests wait on it and started
again as its supervisor would (same ports, same NIXL agent name)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from dsv4_cluster.router.app import build_app
from tests.helpers import metric, wait_for
from tests.router_fakes import router_settings
from tests.servers import UvicornThread
from tests.worker_procs import WorkerPair, restart, start_pair, stop_pair

ADMIN_TOKEN = "admin-token-0123456789abcdef"
IN_FLIGHT = 'dsv4_router_worker_in_flight{role="prefill"'   # until the prefill answers


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = start_pair(tmp_path_factory.mktemp("hold"), prefill_extra=["--test-hooks"])
    try:
        yield pair
    finally:
        stop_pair(pair)



def test_plain_requests_on_the_only_prefill_are_held_across_its_restart(pair: WorkerPair) -> None:
    settings = router_settings(pair.prefill_url, pair.decode_url, stream_hold_s=30, health_check_interval_s=0.2)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": pair.bootstrap_port})]})
    with UvicornThread(build_app(settings)) as router:
        httpx.post(pair.prefill_url + "/debug/stall_engine?seconds=3", timeout=5)   # the 8 wait on the prefill

        async def eight() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(router.url + "/v1/chat/completions", json={
                    "model": "dsv4-tiny", "messages": [{"role": "user", "content": f"held {i}"}], "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}) for i in range(8)))

        async def scenario() -> tuple[list[httpx.Response], float]:
            load = asyncio.create_task(eight())
            await asyncio.to_thread(wait_for, lambda: metric(router.url, IN_FLIGHT) == 8, 10,
                                    "the 8 requests to be in flight on the stalled prefill")
            os.kill(pair.procs[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.to_thread(restart, pair, 0)
            return await load, time.monotonic() - killed

        answers, outage_s = asyncio.run(scenario())
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in answers)
        assert outage_s > 1.0, "the prefill was down for its restart, and the requests waited through it"
        tries = metric(router.url, "dsv4_router_stream_hold_tries_total")
        assert 8 <= tries <= 8 * outage_s, "each held request tried again, at most once a second"


def test_a_held_request_ends_as_soon_as_no_worker_of_its_pool_will_come_back(pair: WorkerPair) -> None:
    """The only prefill dies under a request and its supervisor gives up (FAILED: a crash loop): the hold ends then,
    not `stream_hold_s` later, with the pool's 503 saying so (no Retry-After), since nothing comes back until the
    operator acts."""
    settings = router_settings(pair.prefill_url, pair.decode_url, stream_hold_s=30, health_check_interval_s=0.2,
                               admin_token=ADMIN_TOKEN)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": pair.bootstrap_port})]})
    try:
        with UvicornThread(build_app(settings)) as router:
            greedy = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "after"}], "max_tokens": 8,
                      "temperature": 0, "ignore_eos": True}
            before = httpx.post(router.url + "/v1/chat/completions", json=greedy, timeout=60)
            assert before.status_code == 200, before.text
            httpx.post(pair.prefill_url + "/debug/stall_engine?seconds=3", timeout=5)

            async def scenario() -> tuple[httpx.Response, float]:
                async with httpx.AsyncClient(timeout=120) as client:
                    asked = asyncio.create_task(client.post(router.url + "/v1/chat/completions", json={
                        "model": "dsv4-tiny", "messages": [{"role": "user", "content": "held"}], "max_tokens": 8}))
                    await asyncio.to_thread(wait_for, lambda: metric(router.url, IN_FLIGHT) == 1, 10,
                                            "the request in flight on the stalled prefill")
                    os.kill(pair.procs[0].pid, signal.SIGKILL)
                    await asyncio.sleep(1.0)   # held by now: the prefill's connection failed
                    assert not asked.done(), asked.result().text   # held, not failed at once
                    failed = await client.post(router.url + "/admin/workers/prefill-0/state", headers={
                        "Authorization": f"Bearer {ADMIN_TOKEN}"}, json={"state": "FAILED", "reason": "crash loop"})
                    assert failed.status_code == 200, failed.text
                    told = time.monotonic()
                    return await asked, time.monotonic() - told

            answer, after_s = asyncio.run(scenario())
            restart(pair, 0)    # the operator brings it back: READY again, and it serves the same answer
            auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            assert httpx.post(router.url + "/admin/workers/prefill-0/state", headers=auth, timeout=10,
                              json={"state": "READY", "reason": None}).status_code == 200
            after = wait_for(lambda: (r := httpx.post(router.url + "/v1/chat/completions", json=greedy,
                                                      timeout=60)).status_code == 200 and r, 30, "served again")
            assert after.json()["choices"] == before.json()["choices"], (after.text, before.text)
        assert answer.status_code == 503 and "Retry-After" not in answer.headers, answer.text
        said = answer.json()["error"]["message"]
        assert said.startswith("no prefill worker can take requests now (1 of 1 FAILED") and said.endswith(
            "none will until the operator brings one back"), said
        assert after_s < 5.0, f"the hold went on {after_s:.1f} s after the prefill was reported FAILED"
    finally:
        if pair.procs[0].poll() is not None:   # failed before the restart above
            restart(pair, 0)
