"""Per-stage backpressure (router/backpressure.py): a stage whose every eligible worker's queue is at its limit
gets new requests refused at admission with 503 + Retry-After from the worse stage; a worker's own 503s never
open its breaker."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from dsv4_cluster.router.backpressure import check_stages
from dsv4_cluster.router.errors import Saturated
from dsv4_cluster.router.health import QUEUED, TOKEN_USAGE
from dsv4_cluster.router.pool import WorkerPool
from dsv4_cluster.router.settings import RouterSettings

from .test_router import Cluster, chat, cluster  # noqa: F401 (the module's fake-worker cluster fixture)


def _state(**extra) -> SimpleNamespace:
    settings = RouterSettings(model_name="m", health_check_interval_s=2.0, **extra,
                              prefill=[{"name": f"p{i}", "url": f"http://127.0.0.1:{1000 + i}",
                                        "bootstrap_host": "127.0.0.1"} for i in range(2)],
                              decode=[{"name": f"d{i}", "url": f"http://127.0.0.1:{2000 + i}"} for i in range(2)])
    return SimpleNamespace(settings=settings, pool=WorkerPool(settings))


def test_a_stage_is_saturated_only_when_every_eligible_worker_is_at_its_limit():
    state = _state(max_queued_per_worker=4)
    p0, p1 = state.pool.prefill
    d0, d1 = state.pool.decode
    p0.queued, p1.queued = 9, 3
    check_stages(state)                                       # p1 can still take it
    p1.queued = 4
    with pytest.raises(Saturated) as e:
        check_stages(state)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "2"}          # ceil(2 s x 4/4)
    assert "every prefill worker has 4 or more requests queued" in e.value.message
    d0.queued, d1.queued = 40, 12                             # decode is worse: 12/4 = 3 x its limit
    with pytest.raises(Saturated) as e:
        check_stages(state)
    assert e.value.headers == {"Retry-After": "6"} and "decode worker" in e.value.message
    d1.drained = True                                         # only eligible workers count
    with pytest.raises(Saturated) as e:
        check_stages(state)
    assert e.value.headers == {"Retry-After": "20"}           # d0 alone: ceil(2 x 40/4)
    check_stages(_state(max_queued_per_worker=0))             # off


def test_health_checks_read_the_queue_from_sglangs_metric_names():
    text = (b'sglang:num_queue_reqs{model_name="m",engine_type="decode"} 7.0\n'
            b'sglang:token_usage{model_name="m",engine_type="decode"} 0.25\n')
    assert float(QUEUED.search(text).group(1)) == 7 and float(TOKEN_USAGE.search(text).group(1)) == 0.25


def test_a_workers_own_503s_never_open_its_breaker(cluster: Cluster) -> None:  # noqa: F811
    for _ in range(cluster.settings.breaker_failures + 3):
        cluster.reset(prefill="hold", decode="fail")          # the decode answers 503 "no KV room"
        assert chat(cluster.router.url).status_code == 503
    health = httpx.get(cluster.router.url + "/health").json()
    assert health["decode"]["eligible"] == 1, "still paired: pushback is not a failure of the connection"
