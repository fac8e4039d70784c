"""Bad input against a running cluster (`reliability.py`): schemathesis, oversized and malformed bodies, slowloris.

Bad input: schemathesis draws positive and negative cases for every operation of the router's and a worker's
`/openapi.json` and checks each answer (no 5xx; a status and body the document declares, the error envelope for
errors; a declared content type), with generation lengths clamped to 8 tokens (and `n` <= 2) so hundreds of cases
fit in minutes; the worker's fuzz leaves out the fields the router sets (`bootstrap_*`, `rid`: with them a worker
waits for its peer). Then bodies past the size limit (413), malformed bodies (a 4xx naming the problem), slowloris.
"""

from __future__ import annotations

import math
import socket
import time

import httpx

from .common import rss_bytes
from .reliability_faults import Cluster

CLAMPS = {"max_tokens": 8, "max_new_tokens": 8, "max_completion_tokens": 8, "n": 2}
ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")
SKIP_WORKER = ("/debug/", "/abort_request")   # test hooks; an abort by a made-up rid is a no-op by design


def _clamp(body: object) -> None:
    if isinstance(body, dict):
        for key, cap in CLAMPS.items():
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
                body[key] = cap
        _clamp(body.get("sampling_params"))


def fuzz(name: str, base_url: str, cases: int, skip: tuple[str, ...] = (), strip_router_fields: bool = False,
         seed: int = 0) -> dict:
    """About `cases` schemathesis cases spread over the operations of `base_url`'s OpenAPI document."""
    import schemathesis

    doc = httpx.get(base_url + "/openapi.json", timeout=30).json()
    for op in (op for item in doc["paths"].values() for op in item.values() if strip_router_fields):
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        for name in ROUTER_FIELDS:
            schema.get("properties", {}).pop(name, None)
    ops = [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]
    ops = [op for op in ops if not any(s in op.path for s in skip)]
    counts, statuses, failures, skipped = {"cases": 0, "server_errors": 0, "schema_breaking": 0}, {}, [], []
    started = time.monotonic()
    for round_ in range(6):   # rounds with fresh seeds until `cases` were sent (cheap operations run dry)
        missing = cases - counts["cases"]
        if missing <= 0:
            break
        per_op = max(1, math.ceil(missing / len(ops) / 2)) * (round_ + 1)
        _round(ops, per_op, seed + round_, base_url, counts, statuses, failures, skipped)
    return {"name": name, **counts, "failures": failures, "statuses": dict(sorted(statuses.items())),
            "operations": len(ops), "no_cases": sorted(set(skipped)), "wall_s": round(time.monotonic() - started, 1),
            "ok": counts["server_errors"] == 0 and counts["schema_breaking"] == 0 and counts["cases"] > 0}


def _round(ops, per_op: int, seed: int, base_url: str, counts: dict, statuses: dict, failures: list,
           skipped: list) -> None:
    from hypothesis import HealthCheck, Phase, given, settings, seed as hseed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hseed(seed)
            @settings(max_examples=per_op, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case) -> None:
                _clamp(getattr(case, "body", None))
                try:
                    response = case.call(base_url=base_url, timeout=60)
                except OSError as exc:   # requests' ConnectionError is an OSError
                    counts["cases"] += 1
                    counts["server_errors"] += 1
                    failures.append(f"{op.method.upper()} {op.path}: no answer: {exc!r}"[:300])
                    return
                counts["cases"] += 1
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    counts["server_errors"] += 1
                try:
                    case.validate_response(response, checks=checks)
                except FailureGroup as group:
                    if response.status_code < 500:
                        counts["schema_breaking"] += 1
                    if len(failures) < 12:
                        titles = "; ".join(str(getattr(f, "title", f)) for f in group.exceptions)
                        failures.append(f"{op.method.upper()} {op.path} -> {response.status_code}: {titles}: "
                                        f"{response.text[:160]!r}"[:400])
            try:
                one()
            except Unsatisfiable:   # nothing to break (a GET without parameters has no negative cases)
                skipped.append(f"{op.method.upper()} {op.path} {mode.value}")


def _raw(port: int, data: bytes, read_s: float = 15.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, read until the server closes or `read_s`; the answer and seconds."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and len(out) > 200:
                    break
        except socket.timeout:
            pass
    return out, time.monotonic() - started


def oversized(port: int, limit: int = 32 * 2**20) -> dict:
    """A body past the router's limit (Content-Length) and a chunked one that grows past it: 413 both."""
    results = []
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\n\r\n").encode()
    answer, took = _raw(port, head + b"{")
    results.append(("content-length past the limit", answer.split(b"\r\n", 1)[0], took))
    with httpx.Client(timeout=60) as c:
        def chunks():
            piece = b"x" * 2**20
            yield b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "'
            for _ in range(limit // len(piece) + 2):
                yield piece
        try:
            started = time.monotonic()
            r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=chunks())
            results.append(("chunked past the limit", f"HTTP/1.1 {r.status_code}".encode(), time.monotonic() - started))
        except httpx.HTTPError as exc:
            results.append(("chunked past the limit", f"closed: {exc!r}".encode(), time.monotonic() - started))
    ok = all(b" 413" in status for _, status, _ in results)
    return {"name": "oversized bodies -> 413", "cases": len(results), "server_errors": 0, "failures":
            [] if ok else [f"{n}: {s!r} in {t:.1f}s" for n, s, t in results],
            "detail": "; ".join(f"{n}: {s.decode(errors='replace')} in {t:.2f}s" for n, s, t in results), "ok": ok}


MALFORMED = [
    b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"model": "dsv4-tiny", "messages": "hi"}',
    b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
    b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}',
    b'{"model": "dsv4-tiny", "messages": [{"role": "user", "content": "hi"}], "bootstrap_room": 1}',
    b'{"model": "dsv4-tiny", "prompt": [[1, 2], [99999999999999999999]], "max_tokens": 2}',
    b'{"model": "' + b"m" * 100000 + b'"}',
]


def malformed(router_url: str, decode_url: str) -> dict:
    """Broken JSON and wrong shapes to the router and (JSON-level) to a worker: a 4xx with the envelope each."""
    bad = []
    n = 0
    with httpx.Client(timeout=60) as c:
        for base, paths in ((router_url, ("/v1/chat/completions", "/v1/completions", "/generate")),
                            (decode_url, ("/v1/chat/completions", "/generate"))):
            for path in paths:
                for raw in MALFORMED:
                    n += 1
                    r = c.post(base + path, content=raw, headers={"content-type": "application/json"})
                    try:
                        message = r.json()["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        message = None
                    if not 400 <= r.status_code < 500 or not message:
                        bad.append(f"{base.rsplit(':', 1)[1]}{path} {raw[:40]!r} -> {r.status_code} {r.text[:120]!r}")
    return {"name": "malformed bodies -> 4xx naming the problem", "cases": n, "server_errors":
            sum(" -> 5" in b for b in bad), "failures": bad, "ok": not bad}


def slowloris(port: int, pid: int, connections: int = 64, hold_s: float = 20.0,
              head_timeout_s: float = 10.0) -> dict:
    """`connections` clients that send a request head one byte a second and never finish; meanwhile the router
    must answer others at once and its RSS must stay bounded; when the hold outlasts the router's
    `request_head_timeout_s` (default 10 s) by 3 s, the router must have answered 408 and closed every one."""
    rss_before = rss_bytes(pid) or 0
    socks = []
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        socks.append(s)
    closed: dict[int, float] = {}
    worst, start = 0.0, time.monotonic()
    end = start + hold_s
    with httpx.Client(timeout=10) as c:
        while time.monotonic() < end:
            for i, s in ((i, s) for i, s in enumerate(socks) if i not in closed):
                try:   # the router closed it (recv b""), or it refuses the next byte
                    if s.recv(4096) == b"":
                        closed[i] = time.monotonic() - start
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed[i] = time.monotonic() - start
                    continue
                try:
                    s.sendall(b"X")
                except OSError:
                    closed[i] = time.monotonic() - start
            started = time.monotonic()
            c.get(f"http://127.0.0.1:{port}/health")
            worst = max(worst, time.monotonic() - started)
            time.sleep(1.0)
    rss_after = rss_bytes(pid) or 0
    for s in socks:
        s.close()
    growth = (rss_after - rss_before) / 2**20
    must_close = hold_s >= head_timeout_s + 3
    failures = []
    if worst >= 2.0 or growth >= 50:
        failures.append(f"worst /health {worst:.2f}s, RSS +{growth:.1f} MiB")
    if must_close and len(closed) < connections:
        failures.append(f"{connections - len(closed)} of {connections} dripping connections still open after "
                        f"{hold_s:g} s (request_head_timeout_s {head_timeout_s:g} s)")
    last = f"; the router closed {len(closed)} of them, the last after {max(closed.values()):.1f} s" if closed else ""
    return {"name": f"slowloris: {connections} connections dripping a head for {hold_s:g} s", "cases": connections,
            "server_errors": 0, "failures": failures,
            "detail": f"worst /health meanwhile {worst:.3f} s; router RSS {rss_before / 2**20:.0f} -> "
                      f"{rss_after / 2**20:.0f} MiB{last}", "ok": not failures}


def input_checks(cluster: Cluster, cases: int) -> dict:
    router_pid = cluster.rows()["router"]["pid"]
    checks = [
        fuzz("schemathesis: router OpenAPI", cluster.router_url, cases),
        fuzz("schemathesis: decode worker OpenAPI", cluster.url("decode"), cases, skip=SKIP_WORKER,
             strip_router_fields=True),
        oversized(cluster.ports["router"]),
        malformed(cluster.router_url, cluster.url("decode")),
        slowloris(cluster.ports["router"], router_pid),
    ]
    return {"checks": checks, "ok": all(c["ok"] for c in checks)}
