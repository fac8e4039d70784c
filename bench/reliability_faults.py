"""The faults of the reliability bench, each injected under in-flight requests on a real embedded cluster.

One fault run (`run_fault`):
  1. the idle KV usage of every worker (the baseline), from each worker's `/server_info`;
  2. `clients` chat requests through the router, half streaming, each long enough to be in flight;
  3. the fault, once the requests are where the fault should hit them (mid-stream, or waiting for KV);
  4. every client's outcome (`reliability_clients.py`) and how long after the fault it ended: `hung` past
     `deadline_s` (10 s) counts even when the client got an answer later, except a whole answer within
     `HELD_DEADLINE_S`: `held` (the router held it for its only prefill or decode to come back, `stream_hold_s`);
  5. recovery: a small request every 0.25 s until one succeeds (seconds from the fault), then `after` requests,
     mixed streaming and plain, that must all complete;
  6. KV usage of every worker back to its baseline (bounded wait), and no orphaned or duplicate process (/proc).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

import httpx

from . import proc_probe
from .reliability_clients import Outcome, chat

DEADLINE_S = 10.0
HELD_DEADLINE_S = DEADLINE_S + 15.0 + 5.0   # + the router's default stream_hold_s + the rest of the answer


@dataclass
class FaultResult:
    fault: str
    in_flight: int
    completed: int = 0
    errored: int = 0
    held: int = 0   # completed after DEADLINE_S, within HELD_DEADLINE_S: held for the worker's return
    reset: int = 0
    hung: int = 0
    lost: int = 0
    latest_end_after_fault_s: float | None = None
    recovery_s: float | None = None
    after_ok: int = 0
    after_total: int = 0
    kv_baseline: dict[str, int] = field(default_factory=dict)
    kv_after: dict[str, int] = field(default_factory=dict)
    orphans: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    resets_allowed: bool = False

    @property
    def ok(self) -> bool:
        return (self.hung == 0 and self.lost == 0 and (self.resets_allowed or self.reset == 0)
                and self.recovery_s is not None and self.after_ok == self.after_total
                and self.kv_after == self.kv_baseline and not self.orphans)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


class Cluster:
    """What a fault needs of a running cluster: URLs, pids from `status`, the admin token."""

    def __init__(self, cli: Callable[..., object], router_url: str, ports: dict[str, int], home) -> None:
        self._cli, self.router_url, self.ports, self.home = cli, router_url, ports, home

    def rows(self) -> dict[str, dict]:
        st = self._cli("status", "--json")
        if st.returncode != 0:
            raise RuntimeError(f"status failed: {st.stderr}")
        return {w["name"]: w for w in json.loads(st.stdout)["workers"]}

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    @property
    def worker_ports(self) -> set[int]:
        return {self.ports["prefill"], self.ports["decode"]}

    @property
    def all_ports(self) -> set[int]:
        return set(self.ports.values())


async def _used_tokens(client: httpx.AsyncClient, url: str) -> int | None:
    try:
        r = await client.get(url + "/server_info", timeout=3)
        return r.json()["internal_states"][0]["num_used_tokens"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def kv_usage(cluster: Cluster) -> dict[str, int | None]:
    async with httpx.AsyncClient() as client:
        return {role: await _used_tokens(client, cluster.url(role)) for role in ("prefill", "decode")}


async def kv_back_to(cluster: Cluster, baseline: dict[str, int], limit_s: float = 30.0) -> dict[str, int | None]:
    end = time.monotonic() + limit_s
    while True:
        now = await kv_usage(cluster)
        if now == baseline or time.monotonic() > end:
            return now
        await asyncio.sleep(0.5)


async def recover(router_url: str, since: float, limit_s: float = 120.0) -> float | None:
    """Seconds from `since` to the first 200 of a small request through the router (None: never)."""
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - since < limit_s:
            outcome = await chat(client, router_url, "are you back?", 2, stream=False)
            if outcome.kind == "completed":
                return time.monotonic() - since
            await asyncio.sleep(0.25)
    return None


async def after_requests(router_url: str, count: int) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=60) as client:
        return [await chat(client, router_url, f"after the fault {i}", 6, stream=i % 2 == 0) for i in range(count)]


def _tally(result: FaultResult, outcomes: list[Outcome], fault_at: float) -> None:
    for o in outcomes:
        kind = o.kind
        if kind in ("completed", "errored", "reset") and o.ended - fault_at > DEADLINE_S:
            held = kind == "completed" and o.ended - fault_at <= HELD_DEADLINE_S
            kind = "held" if held else "hung"   # it ended later than the fault's deadline
        setattr(result, kind, getattr(result, kind) + 1)
        if kind != "completed" and len(result.samples) < 4:
            result.samples.append(f"{kind} {o.ended - fault_at:+.1f}s: {o.detail}"[:240])
    ends = [o.ended - fault_at for o in outcomes if not (o.kind == "completed" and
                                                          DEADLINE_S < o.ended - fault_at <= HELD_DEADLINE_S)]
    result.latest_end_after_fault_s = round(max(ends), 2) if ends else None


Inject = Callable[[], Awaitable[None]]
Arm = Callable[[], Awaitable[Inject]]   # resolves what the fault needs (a pid: `status` takes seconds) beforehand
Ready = Callable[[asyncio.Event], Awaitable[None]]


async def run_fault(cluster: Cluster, name: str, arm: Arm, ready: Ready, clients: int = 8,
                    prompt_chars: int = 100, max_tokens: int = 200, after: int = 10,
                    resets_allowed: bool = False, settle: Callable[[], Awaitable[None]] | None = None) -> FaultResult:
    """Steps 1-6 of the module docstring; `ready(first_token)` returns when the fault should strike."""
    baseline = await kv_usage(cluster)
    inject = await arm()
    result = FaultResult(fault=name, in_flight=0, kv_baseline=baseline, resets_allowed=resets_allowed)
    first_token = asyncio.Event()
    prompt = ("tell me about disaggregated serving. " * 40)[:prompt_chars]
    timeout = httpx.Timeout(DEADLINE_S + 20, connect=5)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients + 4)) as client:
        tasks = [asyncio.ensure_future(chat(client, cluster.router_url, f"{i}: {prompt}", max_tokens,
                                            stream=i % 2 == 0, on_token=first_token.set))
                 for i in range(clients)]
        try:
            await asyncio.wait_for(ready(first_token), 60)
        except asyncio.TimeoutError:
            result.samples.append("the requests never reached the point the fault should strike; struck anyway")
        result.in_flight = sum(not t.done() for t in tasks)
        fault_at = time.monotonic()
        await inject()
        outcomes = await asyncio.gather(*tasks)
    _tally(result, outcomes, fault_at)
    result.recovery_s = await recover(cluster.router_url, fault_at)
    if result.recovery_s is not None:
        result.recovery_s = round(result.recovery_s, 2)
    if settle is not None:
        await settle()
    done = await after_requests(cluster.router_url, after)
    result.after_total, result.after_ok = after, sum(o.kind == "completed" for o in done)
    result.samples += [f"after: {o.kind}: {o.detail}"[:240] for o in done if o.kind != "completed"][:3]
    result.kv_after = await kv_back_to(cluster, baseline)
    result.orphans = proc_probe.orphans(cluster.all_ports, cluster.worker_ports)
    return result


# -- the faults ---------------------------------------------------------------------------------------------

async def mid_stream(first_token: asyncio.Event) -> None:
    await first_token.wait()
    await asyncio.sleep(0.3)


def waiting_for_kv(cluster: Cluster) -> Ready:
    """Strike once the decode has requests waiting for their KV (the prefill computes or WRITEs it)."""
    async def ready(_: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=3) as client:
            while True:
                try:
                    text = (await client.get(cluster.url("decode") + "/metrics")).text
                except httpx.HTTPError:
                    text = ""
                for line in text.splitlines():
                    if line.startswith("sglang:num_decode_transfer_queue_reqs{") and float(line.split()[-1]) > 0:
                        return
                await asyncio.sleep(0.01)
    return ready


async def _pid(cluster: Cluster, name: str) -> int:
    return (await asyncio.to_thread(cluster.rows))[name]["pid"]


def kill(cluster: Cluster, name: str) -> Arm:
    async def arm() -> Inject:
        pid = await _pid(cluster, name)

        async def inject() -> None:
            os.kill(pid, signal.SIGKILL)
        return inject
    return arm


def stop_then_continue(cluster: Cluster, name: str, stopped_s: float, held: list) -> Arm:
    """SIGSTOP now and SIGCONT after `stopped_s` (kept in `held`; its supervisor may have replaced it by then)."""
    async def arm() -> Inject:
        pid = await _pid(cluster, name)
        return lambda: _stop(pid, stopped_s, held)
    return arm


async def _stop(pid: int, stopped_s: float, held: list) -> None:
    os.kill(pid, signal.SIGSTOP)

    async def resume() -> None:
        await asyncio.sleep(stopped_s)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass   # its supervisor killed and replaced it meanwhile
    held.append(asyncio.ensure_future(resume()))


def stall_engine(cluster: Cluster, role: str, seconds: float) -> Arm:
    """The `--test-hooks` endpoint: the engine thread stops, HTTP (and so /health's socket) goes on."""
    async def inject() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.post(cluster.url(role) + "/debug/stall_engine", params={"seconds": seconds})
            r.raise_for_status()

    async def arm() -> Inject:
        return inject
    return arm


async def all_faults(cluster: Cluster, stop_s: float = 20.0, stall_s: float = 20.0,
                     only: set[str] | None = None) -> list[FaultResult]:
    held: list[asyncio.Future] = []

    async def resumed() -> None:
        await asyncio.gather(*held)

    runs: list[tuple[str, Callable[[], Awaitable[FaultResult]]]] = [
        ("kill -9 decode mid-stream", lambda: run_fault(cluster, "kill -9 decode mid-stream",
                                                        kill(cluster, "decode-0"), mid_stream)),
        ("kill -9 prefill during KV transfer", lambda: run_fault(
            cluster, "kill -9 prefill during KV transfer", kill(cluster, "prefill-0"), waiting_for_kv(cluster),
            prompt_chars=380, max_tokens=100)),
        ("kill -9 router", lambda: run_fault(cluster, "kill -9 router", kill(cluster, "router"), mid_stream,
                                             resets_allowed=True)),
        (f"SIGSTOP decode {stop_s:g} s", lambda: run_fault(
            cluster, f"SIGSTOP decode {stop_s:g} s", stop_then_continue(cluster, "decode-0", stop_s, held),
            mid_stream, settle=resumed)),
        (f"decode engine stalls {stall_s:g} s (health socket answers)", lambda: run_fault(
            cluster, f"decode engine stalls {stall_s:g} s (health socket answers)",
            stall_engine(cluster, "decode", stall_s), mid_stream)),
    ]
    results = []
    for name, run in runs:
        if only is None or any(key in name for key in only):
            results.append(await run())
            await wait_all_ready(cluster)
    return results


async def wait_all_ready(cluster: Cluster, limit_s: float = 120.0) -> None:
    """Until `status` shows every process READY (the next fault starts from a whole cluster)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        rows = await asyncio.to_thread(cluster.rows)
        if all(r["state"] == "READY" for r in rows.values()):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the cluster is not READY {limit_s:g} s after a fault: {rows}")
