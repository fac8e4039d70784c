"""Streamed chat load against an OpenAI-compatible endpoint at one concurrency (`dsv4-cluster bench`,
`python -m bench.load`).

Timings come from the stream (TTFT to the first content chunk; TPOT over the tokens after it), token counts from
the server's `usage`. A failed request is counted under a short reason, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LevelSpec:
    """What one level sends: `requests` requests, `concurrency` at a time."""

    requests: int
    concurrency: int
    max_tokens: int = 64
    prompt_chars: int = 200
    model: str = "dsv4-tiny"
    api_key: str | None = None
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class Progress:
    concurrency: int
    done: int
    total: int
    errors: int
    output_tokens: int
    elapsed_s: float


@dataclass
class _Outcome:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_at: float     # time.monotonic() of the first token
    ended_at: float

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


class RequestFailed(RuntimeError):
    """One request did not complete; `reason` is the short key it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class LevelResult:
    requests: int
    concurrency: int
    max_tokens: int
    prompt_chars: int
    prompt_tokens_mean: float
    errors: int
    errors_by_reason: dict[str, int]
    error_samples: list[str]
    wall_s: float
    output_tokens: int
    output_tok_s: float
    decode_tok_s: float        # tokens after each first one, over the span from the first first-token to the last end
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def prompt(i: int, chars: int) -> str:
    """Request i's prompt: `chars` printable ASCII characters (one token each on the embedded byte tokenizer)."""
    words = f"request {i}: tell me about prefill, decode and KV caches on page {i % 7}. "
    return (words * (chars // len(words) + 1))[:chars]


def _http_failure(status: int, body: bytes) -> RequestFailed:
    """A refusal, counted under its status and error type, with the server's own message (it says what to fix:
    a PD worker's says to send requests to the router)."""
    try:
        err = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        err = {}
    err = err if isinstance(err, dict) else {}
    kind, message = err.get("type") or err.get("code"), err.get("message")
    detail = message if isinstance(message, str) else body[:200].decode(errors="replace")
    return RequestFailed(f"HTTP {status}" + (f" {kind}" if kind else ""), detail)


async def one_request(client: httpx.AsyncClient, url: str, spec: LevelSpec, i: int) -> _Outcome:
    body = {"model": spec.model, "messages": [{"role": "user", "content": prompt(i, spec.prompt_chars)}],
            "max_tokens": spec.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    started = time.monotonic()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise _http_failure(r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                err = chunk["error"]
                kind = err.get("type", "error") if isinstance(err, dict) else "error"
                raise RequestFailed(f"stream error: {kind}", str(err)[:200])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    ttft = ttft if ttft is not None else time.monotonic() - started
                    chunks += 1
    if ttft is None:
        raise RequestFailed("no token", "the stream ended without a content chunk")
    if usage is None:
        raise RequestFailed("no usage", "the stream ended without the usage chunk include_usage asks for")
    ended = time.monotonic()
    return _Outcome(ttft_s=ttft, e2e_s=ended - started, prompt_tokens=int(usage["prompt_tokens"]),
                    output_tokens=int(usage["completion_tokens"]), first_token_at=started + ttft, ended_at=ended)


def _classify(exc: BaseException) -> RequestFailed:
    if isinstance(exc, RequestFailed):
        return exc
    if isinstance(exc, httpx.TimeoutException):
        return RequestFailed("timeout", type(exc).__name__)
    if isinstance(exc, httpx.ConnectError):
        return RequestFailed("connect", str(exc)[:200])
    if isinstance(exc, httpx.HTTPError):
        return RequestFailed(f"http: {type(exc).__name__}", str(exc)[:200])
    return RequestFailed("bad stream", repr(exc)[:200])    # a JSON chunk that does not parse, a missing field


async def run_level(url: str, spec: LevelSpec, progress: Callable[[Progress], None] | None = None,
                    progress_s: float = 2.0) -> LevelResult:
    """Send `spec.requests` streamed requests to `url`, `spec.concurrency` at a time, and measure them."""
    sem = asyncio.Semaphore(spec.concurrency)
    ok: list[_Outcome] = []
    failed: list[tuple[int, RequestFailed]] = []
    before = list(os.getloadavg())

    async def task(client: httpx.AsyncClient, i: int) -> None:
        async with sem:
            try:
                ok.append(await one_request(client, url, spec, i))
            except (httpx.HTTPError, RequestFailed, ValueError, KeyError, TypeError) as exc:
                failed.append((i, _classify(exc)))

    def report(started: float) -> None:
        if progress is not None:
            progress(Progress(spec.concurrency, len(ok) + len(failed), spec.requests, len(failed),
                              sum(o.output_tokens for o in ok), time.monotonic() - started))

    async def ticker(started: float) -> None:
        while True:
            await asyncio.sleep(progress_s)
            report(started)

    limits = httpx.Limits(max_connections=spec.concurrency * 2, max_keepalive_connections=spec.concurrency)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.monotonic()
        ticking = asyncio.create_task(ticker(started))
        try:
            await asyncio.gather(*(task(client, i) for i in range(spec.requests)))
        finally:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
        wall = time.monotonic() - started
        report(started)
    return summarise(spec, ok, failed, wall, before)


def summarise(spec: LevelSpec, ok: list[_Outcome], failed: list[tuple[int, RequestFailed]], wall: float,
              loadavg_before: list[float]) -> LevelResult:
    ttfts = sorted(o.ttft_s for o in ok)
    tpots = sorted(t for o in ok if (t := o.tpot_s) is not None)
    tokens = sum(o.output_tokens for o in ok)
    return LevelResult(
        requests=spec.requests, concurrency=spec.concurrency, max_tokens=spec.max_tokens,
        prompt_chars=spec.prompt_chars,
        prompt_tokens_mean=round(statistics.fmean(o.prompt_tokens for o in ok), 1) if ok else float("nan"),
        errors=len(failed), errors_by_reason=dict(Counter(e.reason for _, e in failed)),
        error_samples=[f"{i}: {e}"[:300] for i, e in failed[:5]], wall_s=round(wall, 3), output_tokens=tokens,
        output_tok_s=round(tokens / wall, 1) if wall > 0 else float("nan"), decode_tok_s=round(decode_rate(ok), 1),
        ttft_p50_s=round(percentile(ttfts, 50), 4), ttft_p99_s=round(percentile(ttfts, 99), 4),
        tpot_p50_s=round(percentile(tpots, 50), 5), tpot_p99_s=round(percentile(tpots, 99), 5),
        e2e_p50_s=round(statistics.median(o.e2e_s for o in ok), 3) if ok else float("nan"),
        loadavg_before=loadavg_before, loadavg_after=list(os.getloadavg()))


def decode_rate(ok: list[_Outcome]) -> float:
    """Output tokens after the first of each request per second of the decode span (first first-token to last end):
    the rate decode sustained, without the prefill time before it (NaN when nothing decoded)."""
    span = max((o.ended_at for o in ok), default=0.0) - min((o.first_token_at for o in ok), default=0.0)
    decoded = sum(o.output_tokens - 1 for o in ok)
    return decoded / span if ok and span > 0 and decoded > 0 else float("nan")


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list; NaN for an empty one."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]
