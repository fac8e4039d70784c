"""Test helper: real HTTP servers on loopback, for tests that need a socket and not a mock transport.

`free_port()` gives a port below 32768 (ports in the ephemeral range linger in TIME_WAIT after load and
make servers fail with "address already in use"). `UvicornThread` serves an ASGI
app from a background thread on a socket it binds itself (SO_REUSEADDR), waits until it accepts, and
stops it cleanly. `StubThread` does the same for a stub PD worker of bench/stubs.py.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from typing import Any

import uvicorn

from bench.stubs import Stats, StubProtocol
from tests.helpers import TimedOut, wait_for

PORT_RANGE = (10000, 32767)


def _bind(host: str, port: int, reuse: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = "0.0.0.0", attempts: int = 200) -> int:
    """A port below 32768 that nothing listens on or lingers on right now (checked without SO_REUSEADDR)."""
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randint(*PORT_RANGE)
        try:
            _bind(host, port, reuse=False).close()
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE} after {attempts} attempts")


def free_ports(count: int, host: str = "0.0.0.0") -> list[int]:
    """`count` distinct free ports: `free_port()` twice may give the same one, as nothing holds it between the calls
    (a prefill given it for its HTTP and its bootstrap server failed to bind the second: a CI run's setup error)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port(host)) not in ports:
            ports.append(port)
    return ports


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound (SO_REUSEADDR) to a free port below 32768, ready to hand to a server."""
    for _ in range(200):
        try:
            return _bind(host, free_port(host), reuse=True)
        except OSError:
            continue
    raise RuntimeError(f"could not bind a free port below {PORT_RANGE[1] + 1} on {host}")


class UvicornThread:
    """Serve `app` on 127.0.0.1 from a thread. Use as a context manager; `url` is its base URL."""

    def __init__(self, app: Any, host: str = "127.0.0.1", startup_timeout_s: float = 10.0,
                 graceful_timeout_s: float = 2.0, **config: Any) -> None:
        self._sock = bound_socket(host)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config.setdefault("log_level", "warning")
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, lifespan="on",
                                                     timeout_graceful_shutdown=graceful_timeout_s, **config))
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self._startup_timeout_s = startup_timeout_s
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # reported by start(); a thread cannot raise into the test
            self._error = exc

    def start(self) -> UvicornThread:
        self._thread.start()
        def started() -> bool:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} failed to start: {self._error!r}")
            return self._server.started

        try:
            wait_for(started, self._startup_timeout_s, f"server on {self.url} to start", interval_s=0.01)
        except TimedOut:
            self.stop()
            raise
        with socket.create_connection((self.host, self.port), timeout=self._startup_timeout_s):
            pass
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"server on {self.url} did not stop within {2 * timeout_s} s")

    def __enter__(self) -> UvicornThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StubThread:
    """A stub worker (bench/stubs.py's `StubProtocol`) served from a thread on its own event loop; `url`,
    `stats`, and `fault` to change."""

    def __init__(self, role: str, sock: socket.socket, fault: str | None = None) -> None:
        self.role, self.fault, self.stats = role, fault, Stats()
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stub-{role}-{self.port}", daemon=True)

    def _protocol(self) -> StubProtocol:
        return StubProtocol(self.role, self.port, self.stats, self.fault)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(self._loop.create_server(self._protocol, sock=self._sock))
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def __enter__(self) -> StubThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"stub {self.role} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
