"""Test helpers shared by every file: one way to wait, and one way to read a running worker or cluster back.

Waits are sized for a loaded 2-core CI machine: a `timeout_s` is a ceiling, never a delay (every wait returns
as soon as its check holds), so a generous one costs nothing when the system is quick.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable

import httpx

from dsv4_cluster.orchestrator.processes import pid_alive

if TYPE_CHECKING:
    from bench.local_cluster import LocalCluster

SOON_S = 30.0  # ceiling on what the system does at once (an abort, a freed page, a health check's verdict)


def wait_for(check: Callable[[], Any], timeout_s: float, what: str = "", interval_s: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy and return that; after `timeout_s` raise an
    AssertionError naming `what` (and the check's last value)."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what or check} (last: {value!r})")
        time.sleep(interval_s)


def gone(pids: list[int], timeout_s: float = SOON_S) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` for all of them to exit (empty: all gone)."""
    end = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def kv_used(url: str) -> int:
    """The KV tokens a worker holds now (its `/server_info`, as SGLang reports `num_used_tokens`)."""
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["num_used_tokens"]


def cluster_status(c: LocalCluster, *extra: str) -> dict[str, Any]:
    """`dsv4-cluster status --json` of a running local cluster."""
    st = c.cli("status", "--json", *extra)
    assert st.returncode == 0, st.stderr
    return json.loads(st.stdout)


def status_rows(c: LocalCluster, *extra: str) -> dict[str, dict[str, Any]]:
    """The status rows by process name."""
    return {w["name"]: w for w in cluster_status(c, *extra)["workers"]}


def wait_row(c: LocalCluster, name: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
    """`name`'s status row once `check(row)` holds; the last row read when `timeout_s` runs out (the caller asserts
    on it, so a failure shows what it was stuck at)."""
    end = time.monotonic() + timeout_s
    while True:
        row = status_rows(c)[name]
        if check(row) or time.monotonic() > end:
            return row
        time.sleep(0.3)


def wait_ready(c: LocalCluster, name: str, restarts: int, timeout_s: float) -> dict[str, Any]:
    """`name`'s row once it is READY after `restarts` restarts (as `wait_row`)."""
    return wait_row(c, name, lambda row: (row["state"], row["restarts"]) == ("READY", restarts), timeout_s)
