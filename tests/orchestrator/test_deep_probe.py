"""The controller's deep prober: it stops at once even with a probe in flight (`down` waits for it); it probes only
pairs whose workers are READY."""

from __future__ import annotations

import socket
import threading
import time

from dsv4_cluster.orchestrator.verify import deep_probe
from dsv4_cluster.orchestrator.verify.deep_probe import DeepProber, PairEndpoints
from tests.helpers import wait_for


def test_stop_does_not_wait_for_a_probe_in_flight() -> None:
    """A worker that takes the probe's request and never answers (a decode that died mid-probe leaves the prefill's
    leg waiting for its 30 s stranded-KV timeout): stop returns within STOP_WAIT_S, not after the probe's timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted, held = threading.Event(), []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)   # read nothing, answer nothing
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    prober = DeepProber((), interval_s=0.1)
    prober._pairs = [PairEndpoints("prefill-0", "decode-0", url, "127.0.0.1", port, url)]
    prober.start()
    try:
        assert accepted.wait(10), "the probe never reached the worker"
        time.sleep(0.2)                      # its legs are waiting for answers now
        started = time.monotonic()
        prober.stop()
        took = time.monotonic() - started
        assert took < deep_probe.STOP_WAIT_S + 1.0, f"stop waited {took:.1f} s for the probe in flight"
        assert not prober.results(), "a probe cut short by stop reported a result"
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_a_pair_with_a_worker_not_ready_is_not_probed_and_its_last_result_dropped() -> None:
    """A drained, stopped or restarting decode: no probe of its pairs (a failure would be the operator's own doing)
    and no stale result in `status`; once READY again it is probed again."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()   # nothing listens: a probe fails at once (connection refused)
    url, ready = f"http://127.0.0.1:{port}", {"prefill-0": True, "decode-0": True}
    prober = DeepProber((), interval_s=0.05, ready=lambda name: ready[name])
    prober._pairs = [PairEndpoints("prefill-0", "decode-0", url, "127.0.0.1", port, url)]
    prober.start()
    try:
        assert [r.ok for r in wait_for(prober.results, 10, "a first probe")] == [False]
        ready["decode-0"] = False
        wait_for(lambda: prober.results() == (), 10, "the not-ready pair's result dropped")
        ready["decode-0"] = True
        assert len(wait_for(prober.results, 10, "a probe once READY again")) == 1
    finally:
        prober.stop()
