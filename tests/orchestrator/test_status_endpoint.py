"""The status endpoint: what the controller serves on loopback and `dsv4-cluster status` reads without Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_cluster.core import ClusterStatus, KvUsage, ProbeResult, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.supervise import status_endpoint as se

ROW = WorkerStatus("decode-0", Role.DECODE, "local", WorkerState.READY, 42, 30200, 0, KvUsage(16384, 128),
                   "/x/decode-0.log", kernels=(("indexer", "reference"),), history=[{"at": 1.0, "state": "READY"}])
PROBE = ProbeResult("prefill-0", "decode-0", True, 0.5, 1.0)


def test_status_is_read_at_each_request_and_the_record_goes_with_the_server(tmp_path: Path) -> None:
    with pytest.raises(se.EndpointUnavailable, match="no status endpoint recorded"):
        se.read_status(tmp_path)
    calls: list[int] = []

    def read() -> ClusterStatus:
        calls.append(1)
        return ClusterStatus("http://127.0.0.1:30001/v1", (ROW,) * len(calls), (PROBE,))

    server = se.StatusServer(read, tmp_path)
    server.start()
    try:
        record = json.loads(se.endpoint_path(tmp_path).read_text())
        assert record["url"] == server.url and server.url.startswith("http://127.0.0.1:")
        assert se.read_status(tmp_path) == ClusterStatus("http://127.0.0.1:30001/v1", (ROW,), (PROBE,))  # all of it
        assert len(se.read_status(tmp_path).workers) == 2   # read now, at every request: never a stale copy
    finally:
        server.stop()
    assert not se.endpoint_path(tmp_path).exists()
    se.endpoint_path(tmp_path).write_text(json.dumps(record))  # a record left by a controller that died
    with pytest.raises(se.EndpointUnavailable, match="does not answer") as refused:
        se.read_status(tmp_path, timeout_s=5)
    key = record["url"].rsplit("/", 1)[1]
    assert key not in str(refused.value) and "urlopen" not in str(refused.value)   # the key is the endpoint's secret


def test_another_controller_on_a_dead_ones_port_is_not_read_as_its_status(tmp_path: Path) -> None:
    """A controller SIGKILLed leaves its record; its port is free, and another cluster's controller may get it (CI
    saw `status` of a cluster whose head was killed print a parallel test's cluster, READY). The key in the path
    tells them apart."""
    dead, other = tmp_path / "dead", tmp_path / "other"
    dead.mkdir()
    other.mkdir()
    first = se.StatusServer(lambda: ClusterStatus("http://127.0.0.1:1/v1", (ROW,), ()), dead)
    first.start()
    port = first.url.split(":")[2].split("/")[0]
    left = se.endpoint_path(dead).read_text()
    first.stop()
    se.endpoint_path(dead).write_text(left)
    # the same port, as the kernel may hand it to the next controller's bind
    second = se.StatusServer(lambda: ClusterStatus("http://127.0.0.1:2/v1", (ROW,), ()), other, port=int(port))
    second.start()
    try:
        assert second.url.rsplit("/", 1)[0] == json.loads(left)["url"].rsplit("/", 1)[0]  # same host:port
        assert se.read_status(other).endpoint == "http://127.0.0.1:2/v1"
        with pytest.raises(se.EndpointUnavailable, match="404"):
            se.read_status(dead)
    finally:
        second.stop()


def test_a_failing_status_read_is_a_500_the_cli_falls_back_on(tmp_path: Path) -> None:
    def read() -> ClusterStatus:
        raise RuntimeError("a supervisor is gone")

    server = se.StatusServer(read, tmp_path)
    server.start()
    try:
        with pytest.raises(se.EndpointUnavailable, match="500"):
            se.read_status(tmp_path)
    finally:
        server.stop()
