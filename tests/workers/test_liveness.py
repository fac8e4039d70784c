"""The engine liveness ping (workers/http/liveness.py): a stalled engine loop seen from the HTTP side, and its
return."""

from __future__ import annotations

import asyncio
import time

from dsv4_cluster.workers.engine.loop import Engine
from dsv4_cluster.workers.http.liveness import Liveness


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
