"""The controller's deep prober stops at once even with a probe in flight (`down` waits for it)."""

from __future__ import annotations

import socket
import threading
import time

from dsv4_cluster.orchestrator.verify import deep_probe
from dsv4_cluster.orchestrator.verify.deep_probe import DeepProber, PairEndpoints


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
