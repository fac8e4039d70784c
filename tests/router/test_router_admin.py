"""The admin API (`docs/router_admin.md`), the pool it steers and `/health`, against fake workers on loopback."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
import pytest

from dsv4_cluster.router.app import build_app
from tests.router_fakes import WAIT_S, FakeWorker, Rendezvous, chat, router_settings
from tests.helpers import SOON_S, wait_for
from tests.servers import UvicornThread

TOKEN = "admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Pools:
    prefill: FakeWorker
    decodes: tuple[FakeWorker, FakeWorker]
    url: str

    def reset(self) -> None:
        for w in (self.prefill, *self.decodes):
            w.reset("ok")

    def admin(self, method: str, path: str, json: dict | None = None, **headers: str) -> httpx.Response:
        return httpx.request(method, self.url + "/admin" + path, json=json, headers=headers or AUTH, timeout=WAIT_S)

    def entry(self, name: str) -> dict:
        return next(w for w in self.admin("GET", "/workers").json()["workers"] if w["name"] == name)

    def decode_hits(self) -> list[int]:
        return [len(d.received) for d in self.decodes]


@pytest.fixture(scope="module")
def pools():
    meet = Rendezvous()
    prefill, decodes = FakeWorker("prefill", meet), (FakeWorker("decode", meet), FakeWorker("decode", meet))
    with UvicornThread(prefill.app()) as p, UvicornThread(decodes[0].app()) as d0, \
            UvicornThread(decodes[1].app()) as d1:
        settings = router_settings(p.url, d0.url, d1.url, admin_token=TOKEN, health_check_interval_s=0.1)
        with UvicornThread(build_app(settings)) as router:
            yield Pools(prefill, decodes, router.url)


def test_admin_api_needs_the_token_and_never_logs_it(pools: Pools, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    for headers in ({"X-None": "1"}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        resp = pools.admin("GET", "/workers", **headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert "admin_token" in resp.json()["error"]["message"] and TOKEN not in resp.text
    listing = pools.admin("GET", "/workers")
    assert listing.status_code == 200
    workers = listing.json()["workers"]
    assert [(w["name"], w["role"]) for w in workers] == [("prefill-0", "prefill"), ("decode-0", "decode"),
                                                         ("decode-1", "decode")]
    assert all(w["state"] == "READY" and w["healthy"] and not w["drained"] and w["in_flight"] == 0
               and w["reason"] is None and w["url"].startswith("http://127.0.0.1:") for w in workers)
    pools.admin("POST", "/workers/decode-0/drain")
    pools.admin("POST", "/workers/decode-0/resume")
    assert TOKEN not in caplog.text and "decode-0" in caplog.text


def test_admin_api_is_closed_without_a_configured_token(pools: Pools) -> None:
    settings = router_settings(pools.prefill.app and "http://127.0.0.1:1", "http://127.0.0.1:2")
    with UvicornThread(build_app(settings)) as router:
        resp = httpx.get(router.url + "/admin/workers", headers=AUTH)
        assert resp.status_code == 403 and "no admin_token" in resp.json()["error"]["message"]


def test_state_drain_and_resume_steer_pairing_and_health(pools: Pools) -> None:
    pools.reset()
    degraded = pools.admin("POST", "/workers/decode-0/state", {"state": "DEGRADED", "reason": "probe failed"})
    assert degraded.json()["state"] == "DEGRADED" and degraded.json()["reason"] == "probe failed"
    assert not degraded.json()["eligible"]
    for _ in range(4):
        assert chat(pools.url).status_code == 200
    assert pools.decode_hits() == [0, 4], "a DEGRADED decode is not paired"
    health = httpx.get(pools.url + "/health")
    assert health.status_code == 200 and health.json()["decode"] == {"eligible": 1, "configured": 2}

    drained = pools.admin("POST", "/workers/decode-1/drain").json()
    assert drained["drained"] and drained["in_flight"] == 0
    assert httpx.get(pools.url + "/health").status_code == 503, "no eligible decode: unhealthy"
    resp = chat(pools.url)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    message = resp.json()["error"]["message"]
    # counts, never names, nor the orchestrator's free-text reason (the log has both)
    assert "1 of 2 DEGRADED" in message and "1 of 2 drained" in message, message
    assert "decode-0" not in message and "decode-1" not in message and "probe failed" not in message
    assert "127.0.0.1" not in message, "internal URLs never reach clients"

    pools.admin("POST", "/workers/decode-0/state", {"state": "READY", "reason": None})
    assert pools.admin("POST", "/workers/decode-1/resume").json()["eligible"]
    pools.reset()
    for _ in range(4):
        assert chat(pools.url).status_code == 200
    assert pools.decode_hits() == [2, 2], "both back in the round robin"
    assert httpx.get(pools.url + "/health").status_code == 200


def test_in_flight_counts_a_running_stream(pools: Pools) -> None:
    pools.reset()
    for d in pools.decodes:
        d.reset("slow")
    with httpx.stream("POST", pools.url + "/v1/chat/completions", timeout=WAIT_S,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream
        assert "tok0" in next(lines)
        busy = [pools.entry(n)["in_flight"] for n in ("prefill-0", "decode-0", "decode-1")]
        assert sorted(busy[1:]) == [0, 1], busy                 # the decode streaming it
        # the prefill answered (its KV went out): its share ended while the stream goes on
        assert wait_for(lambda: pools.entry("prefill-0")["in_flight"] == 0, SOON_S, "the prefill's share ended")
    assert wait_for(lambda: all(pools.entry(n)["in_flight"] == 0 for n in ("prefill-0", "decode-0", "decode-1")),
                    SOON_S, "nothing in flight")


def test_admin_errors_name_what_is_wrong(pools: Pools) -> None:
    resp = pools.admin("POST", "/workers/decode-9/drain")
    assert resp.status_code == 404 and "no worker named 'decode-9'" in resp.json()["error"]["message"]
    resp = pools.admin("POST", "/workers/decode-0/state", {"state": "BUSY"})
    assert resp.status_code == 400 and "state" in resp.json()["error"]["message"]
    resp = pools.admin("POST", "/workers/decode-0/state", {"state": "READY", "extra": 1})
    assert resp.status_code == 400 and "extra" in resp.json()["error"]["message"]


def test_failing_health_checks_take_a_worker_out_and_back(pools: Pools) -> None:
    pools.reset()
    pools.decodes[0].mode = "unhealthy"
    assert wait_for(lambda: not pools.entry("decode-0")["healthy"], SOON_S,
                    "two failed checks at 0.1 s take it out")
    pools.reset()  # mode "ok" again, counts cleared
    pools.decodes[0].mode = "unhealthy"
    for _ in range(3):
        assert chat(pools.url).status_code == 200
    assert pools.decode_hits() == [0, 3]
    pools.decodes[1].mode = "unhealthy"
    assert wait_for(lambda: httpx.get(pools.url + "/health").status_code == 503, SOON_S, "no healthy decode: 503")
    assert chat(pools.url).status_code == 503
    pools.decodes[0].mode = pools.decodes[1].mode = "ok"
    assert wait_for(lambda: pools.entry("decode-0")["healthy"] and pools.entry("decode-1")["healthy"], SOON_S,
                    "both decodes healthy again")  # decode-0 alone back sent 3 of 4 to it (a CI run)
    pools.reset()
    for _ in range(4):
        assert chat(pools.url).status_code == 200
    assert pools.decode_hits() == [2, 2]


def test_a_worker_reported_ready_again_is_paired_at_once_not_after_the_next_health_check() -> None:
    """The supervisor reports READY after its own readiness probes passed (the worker's /health among them): the
    router takes that as a passed check, so `status` saying READY means the router pairs it."""
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet, mode="unhealthy")
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url, admin_token=TOKEN, health_check_interval_s=3600,
                                   health_failures_to_unhealthy=1)  # one round at start, then none for an hour
        with UvicornThread(build_app(settings)) as router:
            pools = Pools(prefill, (decode, decode), router.url)
            assert wait_for(lambda: not pools.entry("decode-0")["healthy"], SOON_S, "the startup check fails it")
            decode.mode = "ok"  # restarted; no health check will run for an hour
            pools.admin("POST", "/workers/decode-0/state", {"state": "RESTARTING", "reason": "exited"})
            assert chat(router.url).status_code == 503
            entry = pools.admin("POST", "/workers/decode-0/state", {"state": "READY"}).json()
            assert entry["healthy"] and entry["eligible"]
            assert chat(router.url).status_code == 200
