"""Test helpers shared by every file: one way to wait, and one way to read a running worker or cluster back.

Waits are sized for a loaded 2-core CI machine: a `timeout_s` is a ceiling, never a delay (every wait returns
as soon as its check holds), so a generous one costs nothing when the system is quick.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable

import httpx

from dsv4_cluster.orchestrator.processes import pid_alive

if TYPE_CHECKING:
    from bench.local_cluster import LocalCluster

SOON_S = 30.0  # ceiling on what the system does at once (an abort, a freed page, a health check's verdict)
# a wait on `dsv4-cluster status` polls this often: each look is a process (~0.4 CPU-s), and looking as fast as it can
# kept one of CI's two cores starting CLI processes while the cluster it waited for restarted on the other
STATUS_POLL_S = 1.0


class TimedOut(AssertionError):
    """A wait's `timeout_s` ran out (a test failure, as any AssertionError)."""


class _Deadline:
    """One wait's end: `done(value)` is whether a look's value ends the wait; past `timeout_s` an AssertionError
    naming `what` (and the last value)."""

    def __init__(self, timeout_s: float, what: Any) -> None:
        self.timeout_s, self.what, self.end = timeout_s, what, time.monotonic() + timeout_s

    def done(self, value: Any) -> bool:
        if value:
            return True
        if time.monotonic() > self.end:
            raise TimedOut(f"timed out after {self.timeout_s:.1f}s waiting for {self.what} (last: {value!r})")
        return False


def wait_for(check: Callable[[], Any], timeout_s: float, what: str = "", interval_s: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy and return that; after `timeout_s` raise an
    AssertionError naming `what` (and the check's last value)."""
    deadline = _Deadline(timeout_s, what or check)
    while not deadline.done(value := check()):
        time.sleep(interval_s)
    return value


async def wait_for_async(check: Callable[[], Any], timeout_s: float, what: str = "", interval_s: float = 0.05) -> Any:
    """`wait_for` inside a running event loop (the loop keeps serving while it waits); `check` may be async."""
    async def look() -> Any:
        value = check()
        return await value if inspect.isawaitable(value) else value

    deadline = _Deadline(timeout_s, what or check)
    while not deadline.done(value := await look()):
        await asyncio.sleep(interval_s)
    return value


def wait_serving(url: str, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
                 log: Callable[[], str] = lambda: "") -> None:
    """Until GET `url` answers 200; fails at once if `proc` exited first; either failure with the tail `log` gives."""
    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited with code {proc.returncode} before answering:\n{log()[-3000:]}")
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet
    try:
        wait_for(answers, timeout_s, f"{what} to answer at {url}", interval_s=0.1)
    except AssertionError as exc:
        if proc is not None and proc.poll() is not None:
            raise                                            # answers() said so, with the log
        raise AssertionError(f"{exc}\n{log()[-3000:]}") from None


def gone(pids: list[int], timeout_s: float = SOON_S) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` for all of them to exit (empty: all gone)."""
    return latest_when(lambda: [p for p in pids if pid_alive(p)], lambda alive: not alive, timeout_s, interval_s=0.1)


def metric(url: str, name: str, timeout_s: float = 5.0) -> float:
    """The sum of a Prometheus metric's samples at `url`/metrics whose line starts with `name` (a family, or one
    labelled series when `name` carries its labels)."""
    text = httpx.get(url + "/metrics", timeout=timeout_s).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


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


def latest_when(read: Callable[[], Any], holds: Callable[[Any], bool], timeout_s: float,
                interval_s: float = 0.05) -> Any:
    """`read()` once `holds` its value; the last value read when `timeout_s` runs out (the caller asserts on it, so a
    failure shows what it was stuck at)."""
    last: list[Any] = []

    def check() -> bool:
        last.append(read())
        return holds(last[-1])
    try:
        wait_for(check, timeout_s, interval_s=interval_s)
    except TimedOut:
        pass
    return last[-1]


def wait_row(c: LocalCluster, name: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
    """`name`'s status row once `check(row)` holds, else the last row read (`latest_when`)."""
    return latest_when(lambda: status_rows(c)[name], check, timeout_s, interval_s=STATUS_POLL_S)


def wait_ready(c: LocalCluster, name: str, restarts: int, timeout_s: float) -> dict[str, Any]:
    """`name`'s row once it is READY after `restarts` restarts (as `wait_row`)."""
    return wait_row(c, name, lambda row: (row["state"], row["restarts"]) == ("READY", restarts), timeout_s)
