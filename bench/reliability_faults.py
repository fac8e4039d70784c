"""The faults of the reliability bench, each injected under in-flight requests, and the client that classifies how
every request ended: `completed` (200 and a whole answer, a stream with a finish_reason and `[DONE]`), `errored`
(an error status with the OpenAI envelope's message, or an error event then `[DONE]`), `reset` (the connection
refused or closed: only acceptable when the router itself was killed), `left` (the client hung up on purpose),
`hung` (no end within the deadline), `lost` (anything else).

One fault run (`run_fault`):
  1. every worker's idle KV usage (`/server_info`), the baseline;
  2. `clients` chat requests through the router, half streaming, long enough to be in flight;
  3. the fault, once the requests are where it should hit them (mid-stream, or waiting for KV);
  4. every outcome and when it ended: past `DEADLINE_S` it is `hung`, except a whole answer within
     `HELD_DEADLINE_S`, `held` (the router held it for its only prefill or decode to come back, `stream_hold_s`);
  5. recovery: a small request every 0.25 s until one succeeds, then `after` requests that must all complete;
  6. KV usage back to its baseline, and no orphaned or duplicate process (/proc).
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
from .local_cluster import status_rows

MODEL = "dsv4-tiny"
DEADLINE_S = 10.0
HELD_DEADLINE_S = DEADLINE_S + 15.0 + 5.0   # + the router's default stream_hold_s + the rest of the answer


@dataclass(frozen=True)
class Outcome:
    kind: str
    ended: float          # monotonic time the request ended (or was given up on)
    started: float
    detail: str = ""
    tokens: int = 0

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


def _error_status(status: int, raw: bytes) -> tuple[str, str]:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "lost", f"HTTP {status} without an error message: {raw[:120]!r}"
    return ("errored", f"HTTP {status}: {message}"[:300]) if message else ("lost", f"HTTP {status}, empty message")


def _plain(status: int, raw: bytes) -> tuple[str, str, int]:
    if status != 200:
        return (*_error_status(status, raw), 0)
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        finished = choice["finish_reason"] is not None and isinstance(choice["message"]["content"], str)
        tokens = answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "lost", f"200 with a malformed body: {raw[:120]!r}", 0
    return ("completed", "", tokens) if finished else ("lost", "200 without a finish_reason", tokens)


class StreamState:
    """What one SSE stream carried so far."""

    def __init__(self) -> None:
        self.tokens, self.finished, self.error, self.done, self.malformed = 0, False, None, False, None

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or (data := line[6:]) == "[DONE]":
            self.done = self.done or line == "data: [DONE]"
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.malformed = data[:120]
            return
        if "error" in event:
            self.error = str(event["error"].get("message", event["error"]))[:300]
        for choice in event.get("choices", []):
            self.tokens += bool(choice.get("delta", {}).get("content"))
            self.finished = self.finished or bool(choice.get("finish_reason"))

    def outcome(self) -> tuple[str, str]:
        if self.malformed is not None:
            return "lost", f"malformed event: {self.malformed!r}"
        if self.error is not None:
            return ("errored", f"error event: {self.error}") if self.done else ("lost", "error event without [DONE]")
        if self.done and self.finished:
            return "completed", ""
        return "lost", f"stream ended without {'a finish_reason' if self.done else '[DONE]'} ({self.tokens} tokens)"


async def chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool,
               leave_after: int | None = None, on_token=None) -> Outcome:
    """One chat request through `url` (a router), classified. `leave_after`: hang up after that many tokens;
    `on_token()` is called at each streamed token (the fault runner waits for requests to be mid-stream)."""
    started = time.monotonic()
    end = lambda kind, detail="", tokens=0: Outcome(kind, time.monotonic(), started, detail, tokens)  # noqa: E731
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    try:
        if not stream:
            r = await client.post(url + "/v1/chat/completions", json=body)
            return end(*_plain(r.status_code, r.content))
        state = StreamState()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return end(*_error_status(r.status_code, await r.aread()))
            async for line in r.aiter_lines():
                before = state.tokens
                state.feed(line)
                if state.tokens > before:
                    if on_token is not None:
                        on_token()
                    if leave_after is not None and state.tokens >= leave_after:
                        return end("left", f"hung up after {state.tokens} tokens", state.tokens)
        return end(*state.outcome(), state.tokens)
    except httpx.TimeoutException as exc:
        return end("hung", f"{type(exc).__name__}: no end within the client's timeout")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return end("reset", f"{type(exc).__name__}: {exc}"[:300])


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
        return (self.hung == self.lost == 0 and (self.resets_allowed or self.reset == 0) and self.recovery_s is not None
                and self.after_ok == self.after_total and self.kv_after == self.kv_baseline and not self.orphans)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


class Cluster:
    """What a check needs of a running cluster: URLs, the `status` rows (pids, logs), its home."""

    def __init__(self, router_url: str, ports: dict[str, int], home) -> None:
        self.router_url, self.ports, self.home = router_url, ports, home

    def rows(self) -> dict[str, dict]:
        return status_rows(self.home)

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"


async def kv_usage(cluster: Cluster) -> dict[str, int | None]:
    async def used(client: httpx.AsyncClient, url: str) -> int | None:
        try:
            r = await client.get(url + "/server_info", timeout=3)
            return r.json()["internal_states"][0]["num_used_tokens"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    async with httpx.AsyncClient() as client:
        return {role: await used(client, cluster.url(role)) for role in ("prefill", "decode")}


async def kv_back_to(cluster: Cluster, baseline: dict[str, int], limit_s: float = 30.0) -> dict[str, int | None]:
    end = time.monotonic() + limit_s
    while (now := await kv_usage(cluster)) != baseline and time.monotonic() < end:
        await asyncio.sleep(0.5)
    return now


async def recover(router_url: str, since: float, limit_s: float = 120.0) -> float | None:
    """Seconds from `since` to the first 200 of a small request through the router (None: never)."""
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - since < limit_s:
            if (await chat(client, router_url, "are you back?", 2, stream=False)).kind == "completed":
                return round(time.monotonic() - since, 2)
            await asyncio.sleep(0.25)
    return None


def _tally(result: FaultResult, outcomes: list[Outcome], fault_at: float) -> None:
    ends = []
    for o in outcomes:
        kind, after = o.kind, o.ended - fault_at
        if kind in ("completed", "errored", "reset") and after > DEADLINE_S:
            kind = "held" if kind == "completed" and after <= HELD_DEADLINE_S else "hung"
        setattr(result, kind, getattr(result, kind) + 1)
        if kind != "held":
            ends.append(after)
        if kind != "completed" and len(result.samples) < 4:
            result.samples.append(f"{kind} {after:+.1f}s: {o.detail}"[:240])
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
                                            stream=i % 2 == 0, on_token=first_token.set)) for i in range(clients)]
        try:
            await asyncio.wait_for(ready(first_token), 60)
        except asyncio.TimeoutError:
            result.samples.append("the requests never reached the point the fault should strike; struck anyway")
        result.in_flight, fault_at = sum(not t.done() for t in tasks), time.monotonic()
        await inject()
        _tally(result, await asyncio.gather(*tasks), fault_at)
    result.recovery_s = await recover(cluster.router_url, fault_at)
    if settle is not None:
        await settle()
    async with httpx.AsyncClient(timeout=60) as client:
        done = [await chat(client, cluster.router_url, f"after the fault {i}", 6, stream=i % 2 == 0)
                for i in range(after)]
    result.after_total, result.after_ok = after, sum(o.kind == "completed" for o in done)
    result.samples += [f"after: {o.kind}: {o.detail}"[:240] for o in done if o.kind != "completed"][:3]
    result.kv_after = await kv_back_to(cluster, baseline)
    result.orphans = proc_probe.orphans(set(cluster.ports.values()), {cluster.ports["prefill"], cluster.ports["decode"]})
    return result


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
                if any(line.startswith("sglang:num_decode_transfer_queue_reqs{") and float(line.split()[-1]) > 0
                       for line in text.splitlines()):
                    return
                await asyncio.sleep(0.01)
    return ready


def kill(cluster: Cluster, name: str, sig: int = signal.SIGKILL, cont_after_s: float | None = None,
         held: list | None = None) -> Arm:
    """`sig` to `name`'s process; with `cont_after_s`, SIGCONT that long after (kept in `held`; its supervisor may
    have replaced the process by then)."""
    async def arm() -> Inject:
        pid = (await asyncio.to_thread(cluster.rows))[name]["pid"]

        async def resume() -> None:
            await asyncio.sleep(cont_after_s)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass   # its supervisor killed and replaced it meanwhile

        async def inject() -> None:
            os.kill(pid, sig)
            if cont_after_s is not None:
                held.append(asyncio.ensure_future(resume()))
        return inject
    return arm


def stop_then_continue(cluster: Cluster, name: str, stopped_s: float, held: list) -> Arm:
    return kill(cluster, name, signal.SIGSTOP, stopped_s, held)


def stall_engine(cluster: Cluster, role: str, seconds: float) -> Arm:
    """The `--test-hooks` endpoint: the engine thread stops, HTTP (and so /health's socket) goes on."""
    async def inject() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            (await client.post(cluster.url(role) + "/debug/stall_engine", params={"seconds": seconds})).raise_for_status()

    async def arm() -> Inject:
        return inject
    return arm


async def all_faults(cluster: Cluster, stop_s: float = 20.0, stall_s: float = 20.0,
                     only: set[str] | None = None) -> list[FaultResult]:
    held: list[asyncio.Future] = []

    async def resumed() -> None:
        await asyncio.gather(*held)

    runs = {"kill -9 decode mid-stream": dict(arm=kill(cluster, "decode-0"), ready=mid_stream),
            "kill -9 prefill during KV transfer": dict(arm=kill(cluster, "prefill-0"), ready=waiting_for_kv(cluster),
                                                       prompt_chars=380, max_tokens=100),
            "kill -9 router": dict(arm=kill(cluster, "router"), ready=mid_stream, resets_allowed=True),
            f"SIGSTOP decode {stop_s:g} s": dict(arm=stop_then_continue(cluster, "decode-0", stop_s, held),
                                                 ready=mid_stream, settle=resumed),
            f"decode engine stalls {stall_s:g} s (health socket answers)": dict(
                arm=stall_engine(cluster, "decode", stall_s), ready=mid_stream)}
    results = []
    for name, kwargs in runs.items():
        if only is None or any(key in name for key in only):
            results.append(await run_fault(cluster, name, **kwargs))
            await wait_all_ready(cluster)
    return results


async def wait_all_ready(cluster: Cluster, limit_s: float = 120.0) -> None:
    """Until `status` shows every process READY (the next fault starts from a whole cluster)."""
    end = time.monotonic() + limit_s
    while True:
        rows = await asyncio.to_thread(cluster.rows)
        if all(r["state"] == "READY" for r in rows.values()):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"the cluster is not READY {limit_s:g} s after a fault: {rows}")
        await asyncio.sleep(1.0)  # each look is a `status` process
