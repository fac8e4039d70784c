"""The controller answers `GET /status` on loopback, so `dsv4-cluster status` needs no Ray driver (connecting one
costs seconds). The URL is in `<run_dir>/status_endpoint.json`; each answer is `status()` at that moment: the
rows the supervisors last pushed (`row_store.py`). When it does not answer, the CLI asks through Ray and says why.
The path carries a key of this server's own (`/status/<key>`): once a controller died, its loopback port is free
for any process to take — another cluster's controller among them — and a server without the key answers 404
instead of some other cluster's status. This module imports no Ray.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from dsv4_cluster.core import ClusterStatus, WorkerStatus
from dsv4_cluster.orchestrator.processes import write_atomically

if TYPE_CHECKING:
    from dsv4_cluster.orchestrator.topology.schema import Topology

ENDPOINT_FILE = "status_endpoint.json"
CONNECT_TIMEOUT_S = 10.0  # status() answers from the pushed rows it holds: only a stuck controller takes long


class EndpointUnavailable(RuntimeError):
    """No status endpoint recorded, or it did not answer (the message says which)."""


def endpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / ENDPOINT_FILE


def read_status(run_dir: str | Path, timeout_s: float = CONNECT_TIMEOUT_S) -> ClusterStatus:
    """The controller's status now, through its endpoint; EndpointUnavailable saying why not."""
    try:
        url = json.loads(endpoint_path(run_dir).read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        raise EndpointUnavailable("no status endpoint recorded") from None
    try:
        with urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - a loopback http URL the controller wrote
            return ClusterStatus.from_dict(json.loads(reply.read()))
    except (URLError, OSError, ValueError, KeyError, TypeError) as e:
        where = url.rsplit("/status/", 1)[0]   # the path's last part is the controller's key: never printed
        why = e if isinstance(e, HTTPError) else getattr(e, "reason", e)   # "HTTP Error 404: ...", or the OS's words
        raise EndpointUnavailable(f"the status endpoint at {where} does not answer ({why})") from None


class StatusServer:
    """The controller's loopback HTTP server: `GET /status/<key>` -> `read()` as JSON."""

    def __init__(self, read: Callable[[], ClusterStatus], run_dir: str | Path, port: int = 0) -> None:
        self._run_dir = Path(run_dir)
        self._path = f"/status/{secrets.token_urlsafe(16)}"
        path = self._path

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != path:
                    self.send_error(404, "not this controller's status path")
                    return
                try:
                    body, code = json.dumps(read().to_dict()).encode(), 200
                except Exception as e:  # noqa: BLE001 - the CLI falls back to Ray and shows this
                    body, code = json.dumps({"error": f"status failed: {e}"}).encode(), 500
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # one line per status call is noise in the actor's log
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)  # 0: any free port
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-endpoint", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{self._path}"

    def start(self) -> None:
        self._thread.start()
        write_atomically(endpoint_path(self._run_dir), json.dumps({"url": self.url, "pid": os.getpid()}))

    def stop(self) -> None:
        """Stop serving and remove the record: a stopped cluster has no status to give."""
        try:
            if json.loads(endpoint_path(self._run_dir).read_text()).get("url") == self.url:
                endpoint_path(self._run_dir).unlink()
        except (OSError, ValueError):
            pass  # already gone, or another controller's: not ours to remove
        self._server.shutdown()
        self._server.server_close()


def predicted_capacity(topology: Topology) -> dict[str, int]:
    """Each worker's predicted KV capacity in tokens (capacity.py), computed where the topology is loaded
    (`up`): the controller adds it to every status row, so a status reader needs neither the topology nor
    the model code that sizes it."""
    from dsv4_cluster.orchestrator.launch.capacity import predict

    return {w.name: predict(topology, w).max_total_num_tokens for w in topology.workers}


def with_predicted_capacity(row: WorkerStatus, predicted: dict[str, int]) -> WorkerStatus:
    """A worker's row with its `kv_predicted_tokens`, and an error line past a 5% miss (the router's as it is)."""
    from dsv4_cluster.orchestrator.launch.capacity import CAPACITY_TOLERANCE

    if row.name not in predicted:
        return row
    p, error = predicted[row.name], row.error
    actual = row.kv.capacity_tokens if row.kv is not None else None
    if p and actual is not None and abs(actual - p) > CAPACITY_TOLERANCE * p:
        note = (f"KV capacity {actual} tokens differs from the predicted {p} by "
                f"{abs(actual - p) / p:.0%} (over {CAPACITY_TOLERANCE:.0%})")
        error = f"{error}; {note}" if error else note
    return replace(row, kv_predicted_tokens=p, error=error)
