"""Units behind the reliability fixes: sampling at extreme values (found by schemathesis: a 500 from torch),
the engine liveness ping (a stalled engine loop seen from the HTTP side), and the router ending the requests
of a worker that failed its health checks."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dsv4_cluster.core import Role, WorkerState
from dsv4_cluster.router.worker import Pair, Worker
from dsv4_cluster.workers.engine.loop import Engine
from dsv4_cluster.workers.http.liveness import Liveness
from dsv4_cluster.workers.engine.sampling import Sampler, SamplingParams
from dsv4_cluster.workers.engine.tokenizer import PRINTABLE_IDS, VOCAB_SIZE


@pytest.mark.parametrize("temperature", [1e-6, 0.5, 2.0, 3e38, 1.7e308])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-300, 5e-324])
def test_sampling_never_fails_on_valid_extremes(temperature, top_p):
    logits = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(1)) * 5
    token = Sampler(VOCAB_SIZE).sample(logits, SamplingParams(temperature=temperature, top_p=top_p, seed=7), 0)
    assert token in PRINTABLE_IDS


def test_a_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.full((VOCAB_SIZE,), -5.0)
    logits[65] = 5.0
    params = SamplingParams(temperature=1.0, top_p=1e-300, seed=3)
    assert {Sampler(VOCAB_SIZE).sample(logits, params, step) for step in range(5)} == {65}


class _Idle(Engine):
    def __init__(self) -> None:
        super().__init__(runner=None, name="liveness-unit")

    def step(self) -> bool:
        return False


def test_liveness_sees_a_stalled_engine_loop_and_its_return():
    engine = _Idle()
    engine.start()

    async def run() -> tuple[str | None, str | None, str | None]:
        live = Liveness(engine, timeout_s=0.5)
        healthy = await live.check(wait_s=1.0)
        engine.call(lambda: time.sleep(1.5))          # the loop stops coming round
        await asyncio.sleep(0.05)
        live.stalled()                                # a ping goes out, and waits behind the stall
        await asyncio.sleep(0.8)
        stalled = live.stalled()
        await asyncio.sleep(1.0)                      # the stall is over: the ping comes back
        return healthy, stalled, await live.check(wait_s=1.0)

    try:
        healthy, stalled, back = asyncio.run(run())
    finally:
        engine.stop()
    assert healthy is None and back is None
    assert stalled is not None and "no progress" in stalled and "--stall-timeout-s" in stalled


def test_a_lost_worker_ends_each_request_it_is_part_of_once():
    p, d = Worker(Role.PREFILL, "p", "http://p:1"), Worker(Role.DECODE, "d", "http://d:1")
    other = Worker(Role.DECODE, "e", "x")
    ended: list[tuple[str, str]] = []
    pairs = [Pair(p, d), Pair(p, other)]
    for pair in pairs:
        pair.on_lost = lambda worker, why, pair=pair: ended.append((pair.decode.name, why))
    assert (p.in_flight, d.in_flight, other.in_flight) == (2, 1, 1)
    d.lost("failed 2 health checks in a row")
    assert ended == [("d", "failed 2 health checks in a row")]
    pairs[0].release()
    pairs[0].release()
    assert (p.in_flight, d.in_flight, d.pairs) == (1, 0, set())
    d.lost("again")                                  # released: nothing left to end
    p.lost("prefill hung")
    assert ended[1:] == [("e", "prefill hung")]
    assert p.state is WorkerState.READY              # losing requests is not a state change (the admin API's)


def test_the_router_openapi_bodies_are_the_workers_models():
    """router/generation_schemas.json (the router reads it: the models pull in torch) equals what the models
    give now; regenerate with `python -m dsv4_cluster.workers.http.openapi`."""
    import json

    from dsv4_cluster.router.app import build_app
    from dsv4_cluster.router.settings import RouterSettings
    from dsv4_cluster.workers.http.openapi import ROUTER_FILE, router_schemas

    assert json.loads(ROUTER_FILE.read_text()) == json.loads(json.dumps(router_schemas())), \
        "router/generation_schemas.json is stale: run python -m dsv4_cluster.workers.http.openapi"
    doc = build_app(RouterSettings(model_name="m")).api.openapi()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["properties"] and "bootstrap_room" not in body["properties"]
