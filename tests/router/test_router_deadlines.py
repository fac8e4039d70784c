"""The router's request deadlines (router/server_protocol.py) on a real router process: a head or a body that
drips in (slowloris) gets 408 and its connection closed, an idle connection is closed, and other clients are
served meanwhile."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.servers import free_port
from tests.helpers import wait_serving

DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    cfg = tmp_path_factory.mktemp("router") / "router.json"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "port": port, "model_name": "m",
                               "request_head_timeout_s": DEADLINE_S, "request_body_timeout_s": DEADLINE_S}))
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.router", "--config", str(cfg),
                             "--log-level", "warning"])
    try:
        wait_serving(f"http://127.0.0.1:{port}/v1/models", 60, "the router", proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _drip_until_closed(sock: socket.socket, drip: bytes | None, limit_s: float) -> tuple[bytes, float]:
    """Send `drip` every 0.2 s (None: send nothing) until the server closes; returns what it sent and when."""
    sock.settimeout(0.2)
    start, got = time.monotonic(), b""
    while time.monotonic() - start < limit_s:
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            if drip:
                try:
                    sock.sendall(drip)
                except OSError:
                    break
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - start


@pytest.mark.parametrize("opening, drip, what", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X", "head"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
     b"content-length: 1000\r\n\r\n{", b" ", "body"),
])
def test_a_dripping_request_gets_408_and_its_connection_closed(router: int, opening: bytes, drip: bytes,
                                                               what: str) -> None:
    with socket.create_connection(("127.0.0.1", router), timeout=5) as sock:
        sock.sendall(opening)
        got, took = _drip_until_closed(sock, drip, limit_s=10 * DEADLINE_S)
        assert took < 5 * DEADLINE_S, f"the server kept a dripping {what} open for {took:.1f} s"
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert f"request {what} did not arrive within".encode() in got
    # meanwhile and afterwards, other clients are served at once
    assert httpx.get(f"http://127.0.0.1:{router}/v1/models", timeout=5).status_code == 200


def test_an_idle_connection_is_closed_and_a_kept_alive_one_still_serves(router: int) -> None:
    with socket.create_connection(("127.0.0.1", router), timeout=5) as sock:
        got, took = _drip_until_closed(sock, None, limit_s=10 * DEADLINE_S)
        assert took < 5 * DEADLINE_S and got.startswith(b"HTTP/1.1 408"), (took, got[:200])
    with httpx.Client(timeout=5) as client:  # one connection, requests spaced below the deadline
        for _ in range(3):
            assert client.get(f"http://127.0.0.1:{router}/v1/models").status_code == 200
            time.sleep(DEADLINE_S / 2)
