"""Serve several ASGI apps from one process (prefill: its API and its bootstrap server), with one SIGTERM handler
that stops them all (uvicorn's own, one per server, would stop only one). An app whose `state.exit_reason()`
says why (its engine died) makes the process exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn
from fastapi import FastAPI

GRACEFUL_SHUTDOWN_S = 5.0   # open connections get this long after SIGTERM


KEEP_ALIVE_S = 65
POLLED_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # hit every few seconds by supervisors, Prometheus


class QuietPolls(logging.Filter):
    """Drops uvicorn's access-log lines of successful GETs of POLLED_PATHS; keeps their errors and all else."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _, method, path, _, status = args
        return not (method == "GET" and str(path).split("?")[0] in POLLED_PATHS and int(status) < 400)


class _Server(uvicorn.Server):
    """uvicorn server whose signal handling is left to `serve_all` (several servers, one process)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve_all(apps: list[tuple[FastAPI, str, int]], log_level: str) -> None:
    """Serve several apps in this event loop until SIGTERM/SIGINT, then shut all of them down."""
    # Idle keep-alive connections outlive the clients' pools (httpx drops them after 5 s): with
    # uvicorn's default of 5 s too, a client could reuse a connection the server was closing,
    # and a request failed with a read error under load (seen through the router).
    servers = [_Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                      timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                      timeout_keep_alive=KEEP_ALIVE_S))
               for app, host, port in apps]
    logging.getLogger("uvicorn.access").addFilter(QuietPolls())  # after uvicorn.Config set its logging up
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    results = await asyncio.gather(*(s.serve() for s in servers), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed or any(not s.started for s in servers):
        raise SystemExit(f"a server failed to start or crashed: {failed or 'port in use?'}")
    died = [reason for app, _, _ in apps if (reason := _exit_reason(app))]
    if died:
        raise SystemExit(f"exiting non-zero: {died[0]}")


def _exit_reason(app: FastAPI) -> str | None:
    reason = getattr(app.state, "exit_reason", None)
    return reason() if reason is not None else None
