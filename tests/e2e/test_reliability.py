"""The reliability bench's faster subset (`bench/reliability.py` runs the whole), on one real embedded cluster:
faults under in-flight requests end every request explicitly within 10 s and the cluster serves again with its
KV back to the baseline and no orphan; bad input gets 4xx, never 5xx; workers bind the node's address, keys and
tokens are enforced and never logged, prompts stay out of logs and metrics; a short mixed soak loses nothing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench import reliability_faults as rf
from bench.reliability import security_checks, soak
from bench.reliability_input import fuzz, malformed, oversized, slowloris

pytestmark = pytest.mark.slow
HOOKS = ", extra_args: [--test-hooks]"


@pytest.fixture(scope="module")
def cluster(local_cluster):
    with local_cluster("reliability", extra_decode=HOOKS, extra_prefill=HOOKS) as c:
        yield rf.Cluster(c.router_url, c.ports, c.home)


def _router_tries(c: rf.Cluster) -> float:
    """Fresh pairs the router tried for requests whose attempt failed: retries and held requests' tries."""
    text = httpx.get(c.router_url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("dsv4_router_retries_total", "dsv4_router_stream_hold_tries_total")))


def _faults(c: rf.Cluster) -> dict:
    held: list = []

    async def resumed() -> None:
        await asyncio.gather(*held)

    return {
        "prefill killed during the KV transfer": dict(arm=rf.kill(c, "prefill-0"), ready=rf.waiting_for_kv(c),
                                                      prompt_chars=380, max_tokens=100),
        "decode SIGSTOPped 12 s": dict(arm=rf.stop_then_continue(c, "decode-0", 12.0, held), ready=rf.mid_stream,
                                      settle=resumed),
        "decode engine stalled 7 s": dict(arm=rf.stall_engine(c, "decode", 7.0), ready=rf.mid_stream),
    }


@pytest.mark.parametrize("fault", ["prefill killed during the KV transfer", "decode SIGSTOPped 12 s",
                                   "decode engine stalled 7 s"])
def test_a_fault_ends_every_request_explicitly_within_10s_and_the_cluster_recovers(cluster, fault):
    kwargs = _faults(cluster)[fault]
    tried = _router_tries(cluster)
    result = asyncio.run(rf.run_fault(cluster, fault, clients=4, after=4, **kwargs))
    summary = result.to_dict()
    # the fault hit requests: some errored, or the router tried them again or held them (a killed prefill's
    # requests are held across its restart and complete)
    assert result.in_flight >= 1 and result.errored + result.held + _router_tries(cluster) - tried >= 1, summary
    assert (result.hung, result.lost, result.reset) == (0, 0, 0), summary
    assert result.completed + result.errored + result.held == 4, summary
    # None: no request ended near the fault, every one was held and completed (a stopped only decode's streams
    # are held for its restart and continued there)
    assert result.latest_end_after_fault_s is None or result.latest_end_after_fault_s <= rf.DEADLINE_S, summary
    assert result.recovery_s is not None and result.after_ok == result.after_total == 4, summary
    assert result.kv_after == result.kv_baseline, summary
    assert result.orphans == [], summary
    asyncio.run(rf.wait_all_ready(cluster))


def test_security(cluster):
    out = security_checks(cluster)
    for check in out["checks"]:
        assert check["ok"], check


def test_schemathesis_finds_no_5xx_and_no_schema_breaking_answer(cluster):
    for result in (fuzz("router", cluster.router_url, 40),
                   fuzz("decode worker", cluster.url("decode"), 30, skip=("/debug/", "/abort_request"),
                        strip_router_fields=True)):
        assert result["cases"] >= 20, result
        assert result["server_errors"] == 0 and result["schema_breaking"] == 0, result


def test_oversized_malformed_and_slow_requests_are_bounded(cluster):
    for result in (oversized(cluster.ports["router"]), malformed(cluster.router_url, cluster.url("decode")),
                   slowloris(cluster.ports["router"], cluster.rows()["router"]["pid"], connections=16, hold_s=3)):
        assert result["ok"], result


def test_a_short_mixed_soak_loses_nothing_and_frees_every_page(cluster):
    out = asyncio.run(soak(cluster, requests=120, concurrency=16))
    assert out["completed"] + out["errored"] + out["left"] == 120, out
    assert (out["lost"], out["hung"], out["reset"]) == (0, 0, 0), out
    assert out["left"] >= 1 and out["completed"] >= 100, out
    assert out["kv_end"] == {"prefill": 0, "decode": 0}, out
