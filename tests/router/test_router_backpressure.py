"""Per-stage backpressure (router/backpressure.py): a stage whose every eligible worker's queue is at its limit
gets new requests refused at admission with 503 + Retry-After from the worse stage; a worker's own 503s never
open its breaker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from dsv4_cluster.router.backpressure import check_stages
from dsv4_cluster.router.errors import Saturated
from dsv4_cluster.core import Role
from dsv4_cluster.router.health import TOKEN_USAGE, queued
from dsv4_cluster.router.pool import WorkerPool
from dsv4_cluster.router.settings import RouterSettings

from tests.router_fakes import router_settings
from tests.helpers import wait_for
from tests.servers import UvicornThread
from tests.worker_procs import start_pair, stop_pair
from dsv4_cluster.router.app import build_app

from tests.router_fakes import Cluster, chat


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


def test_health_checks_read_each_roles_backlog_from_sglangs_queue_gauges():
    """A PD decode's backlog is prealloc + transfer + waiting (SGLang 0.5.23's names), a prefill's bootstrap +
    waiting: reading `num_queue_reqs` alone saw none of a decode's prealloc queue."""
    text = (b'sglang:num_queue_reqs{model_name="m",engine_type="decode"} 1.0\n'
            b'sglang:num_decode_prealloc_queue_reqs{model_name="m",engine_type="decode",dp_rank="0"} 5.0\n'
            b'sglang:num_decode_prealloc_queue_reqs{model_name="m",engine_type="decode",dp_rank="1"} 2.0\n'
            b'sglang:num_decode_transfer_queue_reqs{model_name="m",engine_type="decode"} 3.0\n'
            b'sglang:num_prefill_bootstrap_queue_reqs{model_name="m",engine_type="prefill"} 4.0\n'
            b'sglang:num_prefill_inflight_queue_reqs{model_name="m",engine_type="prefill"} 9.0\n'
            b'sglang:token_usage{model_name="m",engine_type="decode"} 0.25\n')
    assert queued(Role.DECODE, text) == 1 + 5 + 2 + 3 and queued(Role.PREFILL, text) == 4 + 1
    assert float(TOKEN_USAGE.search(text).group(1)) == 0.25


def test_a_workers_own_503s_never_open_its_breaker(cluster: Cluster) -> None:  # noqa: F811
    for _ in range(cluster.settings.breaker_failures + 3):
        cluster.reset(prefill="hold", decode="fail")          # the decode answers 503 "no KV room"
        assert chat(cluster.router.url).status_code == 503
    health = httpx.get(cluster.router.url + "/health").json()
    assert health["decode"]["eligible"] == 1, "still paired: pushback is not a failure of the connection"


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A real embedded pair whose KV pools hold two 200-token requests: the rest wait in the decode's prealloc queue."""
    pair = start_pair(tmp_path_factory.mktemp("backpressure"), extra=["--max-total-tokens", "512", "--context-length", "512"])
    try:
        yield pair
    finally:
        stop_pair(pair)


def test_a_decode_whose_metrics_report_a_full_queue_gets_503_with_retry_after_until_it_drains(small_pair) -> None:
    settings = router_settings(small_pair.prefill_url, small_pair.decode_url, max_queued_per_worker=2,
                               health_check_interval_s=0.2, request_timeout_s=120)
    settings = settings.model_copy(update={"prefill": [settings.prefill[0].model_copy(
        update={"bootstrap_port": small_pair.bootstrap_port})]})
    body = {"model": "dsv4-tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "fill the queue"}]}
    with UvicornThread(build_app(settings)) as router:
        def chat_now() -> httpx.Response:
            return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)

        def refused_now() -> httpx.Response | None:
            """A 503 at once, or None (admitted: it would queue, so the probe leaves after a moment)."""
            try:
                r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=0.5)
            except httpx.TimeoutException:
                return None
            return r if r.status_code == 503 else None

        def chat_as_a_client_would() -> httpx.Response:
            """Retried after a 503's Retry-After: on a loaded machine one of the 6 can arrive after the router's
            metrics poll already counts the others queued (a CI run refused the third)."""
            return wait_for(lambda: (r := chat_now()).status_code != 503 and r, 120, "a chat admitted after 503s",
                            interval_s=1.0)  # as often as Retry-After (>= 1 s) allows

        with ThreadPoolExecutor(6) as pool:
            load = [pool.submit(chat_as_a_client_would) for _ in range(6)]      # 2 run, 4 wait for pages
            refused = wait_for(refused_now, 30, "a 503 while queued")
            assert int(refused.headers["retry-after"]) >= 1
            assert "every decode worker has" in refused.json()["error"]["message"]
            assert [f.result().status_code for f in load] == [200] * 6
        wait_for(lambda: chat_now().status_code == 200, 30, "admitted again once the queue drained")
