"""`dsv4-cluster bench URL`: a concurrency sweep of streamed chat requests against a router (or one worker).

A table per level on stdout; progress, and one failed request of each level with failures (in the server's words),
on stderr; the JSON with `--out`. Exit 0 when every request succeeded, 2 when some failed, 1 when the endpoint does
not answer or `--out` cannot be written (the table is printed first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from dsv4_cluster.orchestrator.load.loadgen import LevelResult, LevelSpec, Progress, run_level

EXIT_OK, EXIT_UNREACHABLE, EXIT_ERRORS = 0, 1, 2
EXIT_UNWRITABLE = EXIT_UNREACHABLE


@dataclass(frozen=True)
class SweepOptions:
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int | None = None          # per level; None: 4 x concurrency, at least 8
    max_tokens: int = 64
    prompt_chars: int = 200
    model: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 600.0
    progress_s: float = 2.0

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(8, 4 * concurrency)


class EndpointError(RuntimeError):
    """The endpoint does not answer `GET /v1/models` (wrong URL, cluster down, bad API key)."""


def served_model(url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EndpointError(f"{url}: no answer to GET /v1/models ({e!r}); is the cluster up "
                            "(`dsv4-cluster status`) and the URL its router's?") from e
    if r.status_code != 200:
        raise EndpointError(f"{url}: GET /v1/models answered {r.status_code}: {r.text[:200]}"
                            + (" (pass --api-key)" if r.status_code == 401 else ""))
    data = r.json().get("data") or []
    if not data:
        raise EndpointError(f"{url}: GET /v1/models lists no model; pass --model")
    return str(data[0]["id"])


def run_sweep(url: str, options: SweepOptions, progress=None) -> dict:
    """Every level in order; the sweep's JSON (options, one record per level)."""
    model = options.model or served_model(url, options.api_key)
    levels: list[LevelResult] = []
    started = time.time()
    for c in options.concurrency:
        spec = LevelSpec(requests=options.requests_at(c), concurrency=c, max_tokens=options.max_tokens,
                         prompt_chars=options.prompt_chars, model=model, api_key=options.api_key,
                         request_timeout_s=options.request_timeout_s)
        levels.append(asyncio.run(run_level(url, spec, progress, options.progress_s)))
    opts = {k: v for k, v in asdict(options).items() if k != "api_key"}
    return {"url": url, "model": model, "started_unix": round(started, 1), "options": opts,
            "levels": [lv.to_dict() for lv in levels]}


def table(sweep: dict) -> str:
    """The sweep as a markdown table, one row per concurrency."""
    head = ("| concurrency | requests | prompt tok | max tokens | output tok/s | decode tok/s | TTFT p50 ms "
            "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors |\n|" + " --- |" * 11)
    rows = [head]
    for lv in sweep["levels"]:
        errs = ", ".join(f"{k} x{n}" for k, n in lv["errors_by_reason"].items()) or "0"
        rows.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['prompt_tokens_mean']} | {lv['max_tokens']} "
                    f"| {lv['output_tok_s']} | {lv['decode_tok_s']} | {_ms(lv['ttft_p50_s'])} | {_ms(lv['ttft_p99_s'])} "
                    f"| {_ms(lv['tpot_p50_s'])} | {_ms(lv['tpot_p99_s'])} | {errs} |")
    return "\n".join(rows) + "\n"


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"


def print_progress(p: Progress) -> None:
    rate = p.output_tokens / p.elapsed_s if p.elapsed_s > 0 else 0.0
    print(f"[bench] concurrency {p.concurrency}: {p.done}/{p.total} done, {p.errors} errors, "
          f"{rate:.1f} output tok/s, {p.elapsed_s:.1f}s", file=sys.stderr, flush=True)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,4,16")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,4,16")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def _base_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        example = "http://127.0.0.1:30001" if "://" in text else f"http://{text}"
        raise argparse.ArgumentTypeError(f"{text!r}: give a full URL such as {example}")
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = SweepOptions()
    p = sub.add_parser("bench", help="load a router (or a worker) with streamed chat requests: a concurrency "
                       "sweep with output tok/s, TTFT and TPOT p50/p99, errors")
    p.add_argument("url", type=_base_url, help="the router's (or a worker's) base URL, e.g. http://127.0.0.1:30001")
    p.add_argument("--concurrency", type=_int_list, default=d.concurrency,
                   help=f"levels, comma-separated (default {','.join(map(str, d.concurrency))})")
    p.add_argument("--requests", type=_positive, default=d.requests,
                   help="requests per level (default 4 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=_positive, default=d.max_tokens,
                   help=f"output tokens of each request, EOS ignored (default {d.max_tokens})")
    p.add_argument("--prompt-chars", type=_positive, default=d.prompt_chars,
                   help=f"prompt length in ASCII characters (default {d.prompt_chars}; the table shows the "
                   "tokens the server counted)")
    p.add_argument("--model", default=d.model, help="model name to send (default: the endpoint's /v1/models)")
    p.add_argument("--api-key", default=d.api_key, help="bearer token, if the router asks for one")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help=f"seconds one request may take (default {d.request_timeout_s:g})")
    p.add_argument("--out", type=Path, help="write the sweep's JSON here")


def main(args: argparse.Namespace) -> int:
    options = SweepOptions(concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
                           prompt_chars=args.prompt_chars, model=args.model, api_key=args.api_key,
                           request_timeout_s=args.request_timeout)
    try:
        sweep = run_sweep(args.url, options, print_progress)
    except EndpointError as e:
        print(f"bench: {e}", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    print(table(sweep), end="", flush=True)  # first: a sweep's result is never lost to an unwritable --out
    for lv in sweep["levels"]:   # the table counts failures by reason; the server's own words say what to fix
        if lv["errors"]:
            print(f"bench: concurrency {lv['concurrency']}: {lv['errors']} of {lv['requests']} requests failed, "
                  f"e.g. request {lv['error_samples'][0]}", file=sys.stderr, flush=True)
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(sweep, indent=1) + "\n")
        except OSError as e:
            print(f"bench: cannot write the sweep's JSON to {args.out} ({e.strerror or e}); the table above is "
                  "its result — pass a writable --out", file=sys.stderr, flush=True)
            return EXIT_UNWRITABLE
    return EXIT_ERRORS if any(lv["errors"] for lv in sweep["levels"]) else EXIT_OK
