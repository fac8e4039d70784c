"""The cluster from outside, as a client sees it: one embedded cluster brought up by the real CLI (Ray,
supervisors, NIXL) whose node is named and addressed by this machine's hostname, so that worker URLs, bootstrap
hosts and NIXL agent names all carry it. Workers are killed (-9) and frozen (SIGSTOP, 5 s) under streaming and
plain load, and poison requests are sent; every byte each client receives (head and body) is scanned:

- no status 500, no `"code": 500`; every request ends; every stream ends with `data: [DONE]`;
- no worker name, host, port, URL or agent name anywhere. The hostname itself is short (it may be two letters),
  so it is looked for outside the generated text only (the tiny model writes random printable text); every other
  needle is looked for in every byte.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import signal
import socket
import time
from dataclasses import dataclass

import httpx
import pytest

from bench.local_cluster import LocalCluster
from dsv4_cluster.workers.http.responses import held_back
from tests.helpers import STATUS_POLL_S, status_rows, wait_for

HOST = socket.gethostname()


def _loopback_name(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


NODE = re.sub(r"[^a-z0-9-]", "-", HOST.split(".")[0].lower()).strip("-") or "node"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _loopback_name(HOST), reason=f"this machine's hostname {HOST!r} does not "
                                 "resolve to a loopback address")]
HOOKS = ", extra_args: [--test-hooks]"
TEXT_KEYS = ("content", "text", "reasoning_content", "token", "tokens", "output_ids", "top_logprobs", "bytes")


@pytest.fixture(scope="module")
def cluster(local_cluster) -> LocalCluster:
    with local_cluster("blackbox", extra_prefill=HOOKS, extra=f"nodes:\n  - {{name: {NODE}, address: {HOST}}}\n") as c:
        yield c


@dataclass
class Seen:
    """One client's whole answer: status, head and body bytes; `ended` False when the connection broke."""

    status: int
    raw: bytes
    stream: bool
    ended: bool = True


async def call(client: httpx.AsyncClient, url: str, path: str, body: dict | bytes,
               started: list[int] | None = None) -> Seen:
    """POST `body` (a dict as JSON, bytes as they are) and keep every byte of the answer."""
    sent = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    stream = isinstance(body, dict) and bool(body.get("stream"))
    try:
        async with client.stream("POST", url + path, **sent) as resp:
            head = b"".join(k + b": " + v + b"\n" for k, v in resp.headers.raw)
            parts = [f"HTTP {resp.status_code}\n".encode(), head]
            async for part in resp.aiter_raw():
                parts.append(part)
                if started is not None and len(parts) == 3:
                    started.append(1)
            return Seen(resp.status_code, b"".join(parts), stream)
    except httpx.HTTPError as exc:
        return Seen(0, repr(exc).encode(), stream, ended=False)


def chat(i: int, stream: bool, max_tokens: int) -> dict:
    return {"model": "dsv4-tiny", "messages": [{"role": "user", "content": f"black box {i}"}], "stream": stream,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _without_text(value):
    """`value` (a parsed body or event) with the generated text left out: what the router and workers wrote."""
    if isinstance(value, dict):
        return {k: _without_text(v) for k, v in value.items() if k not in TEXT_KEYS}
    if isinstance(value, list):
        return [_without_text(v) for v in value]
    return value


def _written(body: bytes) -> str:
    """Every JSON document of a body (SSE events or one JSON body) without generated text; other text as is."""
    out = []
    for piece in re.split(rb"\n\n|\r\n\r\n", body) if b"data:" in body else [body]:
        data = piece.split(b"data:", 1)[-1].strip()
        try:
            out.append(json.dumps(_without_text(json.loads(data))))
        except ValueError:
            out.append(data.decode("utf-8", "replace"))
    return "\n".join(out)


def needles(c: LocalCluster) -> list[str]:
    """What may never reach a client: names, ports, URLs, addresses, agent-name stems."""
    ports = [str(p) for name, p in c.ports.items() if name != "router"]
    return ["prefill-0", "decode-0", "http://", "https://", "127.0.0.1", f"decode-{HOST}", f"prefill-{HOST}",
            *ports, "Traceback", "internal_error"]


def scan(c: LocalCluster, seen: list[Seen]) -> None:
    router_port = str(c.ports["router"]).encode()
    for s in seen:
        assert s.ended, s.raw[-300:]
        assert s.status not in (0, 500), s.raw[-600:]
        raw = s.raw.replace(router_port, b"")
        leaked = [n for n in needles(c) if n.encode() in raw]
        written = _written(raw.split(b"\n", 1)[1])
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(HOST)}(?![A-Za-z0-9])", written, re.IGNORECASE):
            leaked.append(HOST)
        assert not leaked, (leaked, s.raw[-800:])
        assert '"code": 500' not in written, written[-600:]
        if s.stream and s.status == 200:
            assert s.raw.endswith(b"data: [DONE]\n\n"), s.raw[-300:]


def _pid(c: LocalCluster, name: str) -> int:
    return status_rows(c)[name]["pid"]


async def _load(c: LocalCluster, streams: int, plain: int, max_tokens: int, fault) -> list[Seen]:
    """`streams` streaming and `plain` plain chats at once; `fault(started)` runs beside them."""
    started: list[int] = []
    async with httpx.AsyncClient(timeout=120) as client:
        calls = [call(client, c.router_url, "/v1/chat/completions", chat(i, True, max_tokens), started)
                 for i in range(streams)]
        calls += [call(client, c.router_url, "/v1/chat/completions", chat(100 + i, False, max_tokens))
                  for i in range(plain)]
        results = await asyncio.gather(*calls, fault(started))
    return list(results[:-1])


def _back(c: LocalCluster, name: str, restarts: int) -> None:
    wait_for(lambda: (r := status_rows(c)[name])["state"] == "READY" and r["restarts"] >= restarts, 120,
             f"{name} READY again", interval_s=STATUS_POLL_S)


def _prefill_metric(c: LocalCluster, name: str) -> float:
    text = httpx.get(f"http://{HOST}:{c.ports['prefill']}/metrics", timeout=5).text
    assert f"\n{name}" in text, f"the prefill exports no {name}"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _prefill_legs(c: LocalCluster) -> float:
    return _prefill_metric(c, "sglang:num_requests_total")


def test_decode_killed_under_8_streams(cluster: LocalCluster) -> None:
    """The streams are held across the decode's restart and continued there; while held, each starts at most one
    prefill leg a second (none while the decode does not answer), and no attempt leaves KV stranded on the prefill
    (a room no decode came for is counted 5 s after its KV was ready)."""
    rows = status_rows(cluster)["decode-0"]
    before, pid = rows["restarts"], rows["pid"]  # looked up first: the kill must land while the streams run
    killed: list[tuple[float, float]] = []

    async def kill(started: list[int]) -> None:
        await asyncio.to_thread(wait_for, lambda: len(started) >= 8, 60, "8 streams under way")
        legs = _prefill_legs(cluster)
        os.kill(pid, signal.SIGKILL)
        killed.append((time.monotonic(), legs))

    try:
        seen = asyncio.run(_load(cluster, 8, 0, 320, kill))
        held_s, legs = time.monotonic() - killed[0][0], _prefill_legs(cluster) - killed[0][1]
        scan(cluster, seen)
        assert [s.status for s in seen] == [200] * 8, [s.raw[-400:] for s in seen if s.status != 200]
        print(f"decode kill: {legs:.0f} prefill legs for 8 streams in the {held_s:.1f} s after it")
        assert 8 <= legs <= 8 * max(1.0, held_s), "at most one prefill leg per held stream per second"
        time.sleep(max(0.0, killed[0][0] + 6.0 - time.monotonic()))
        assert _prefill_metric(cluster, "dsv4_stranded_kv_rooms") == 0, "an attempt's KV stranded on the prefill"
    finally:  # the module's other tests share this cluster: never leave them a restarting decode
        if killed:
            _back(cluster, "decode-0", before + 1)


def test_prefill_killed_under_8_plain_requests(cluster: LocalCluster) -> None:
    before = status_rows(cluster)["prefill-0"]["restarts"]
    prefill = f"http://{HOST}:{cluster.ports['prefill']}"

    async def kill(_: list[int]) -> None:
        httpx.post(prefill + "/debug/stall_engine?seconds=3", timeout=5)   # the 8 wait on the prefill
        await asyncio.sleep(1.0)
        os.kill(_pid(cluster, "prefill-0"), signal.SIGKILL)

    seen = asyncio.run(_load(cluster, 0, 8, 8, kill))
    try:
        scan(cluster, seen)
        assert [s.status for s in seen] == [200] * 8, ("held across the prefill's restart",
                                                       [s.raw[-400:] for s in seen if s.status != 200])
    finally:
        _back(cluster, "prefill-0", before + 1)


@pytest.mark.parametrize("name", ["decode-0", "prefill-0"])
def test_a_worker_frozen_for_5s_under_load(cluster: LocalCluster, name: str) -> None:
    async def freeze(started: list[int]) -> None:
        await asyncio.to_thread(wait_for, lambda: len(started) >= 4, 60, "the streams under way")
        pid = _pid(cluster, name)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(5)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:   # its supervisor gave up on it and restarted it
                pass

    seen = asyncio.run(_load(cluster, 4, 4, 96, freeze))
    scan(cluster, seen)
    wait_for(lambda: all(r["state"] == "READY" for r in status_rows(cluster).values()), 120, "all READY again",
             interval_s=STATUS_POLL_S)


def test_poison_requests(cluster: LocalCluster) -> None:
    bodies = [("/generate", {"input_ids": [10**9, -5], "sampling_params": {"max_new_tokens": 4}}),
              ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}),
              ("/generate", {"text": "x" * 5000, "sampling_params": {"max_new_tokens": 4}, "stream": True}),
              ("/v1/completions", b'{"prompt": "\\udcff\\ud800x", "max_tokens": 4}'),   # lone surrogates
              ("/v1/completions", b'{"prompt": "a", "max_tokens": 4, "stop": [""]}'),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 5000}], "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "tool", "content": None}], "max_tokens": 4})]

    async def run() -> list[Seen]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [await call(client, cluster.router_url, path, body) for path, body in bodies]

    seen = asyncio.run(run())
    scan(cluster, seen)
    good = httpx.post(cluster.router_url + "/v1/chat/completions", json=chat(0, False, 4), timeout=60)
    assert good.status_code == 200, good.text
    assert all(r["state"] == "READY" for r in status_rows(cluster).values())
    print("poison statuses:", [s.status for s in seen])


# -- a resumed stream, byte for byte -------------------------------------------------------------------------------
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
RESUME_TOKENS = 240


def _resume_body(path: str, i: int, stop: str | None = None) -> dict:
    """A greedy stream of RESUME_TOKENS tokens (EOS included: tokens without text) whose prompt has a multi-byte
    character, so that the tiny model writes some too; prompts differ from their first bytes (no shared page)."""
    prompt = f"{i} résumé, byte for byte: the stream goes on where it broke"
    params = {"temperature": 0, "ignore_eos": True, **({"stop": [stop]} if stop else {})}
    if path == "/generate":
        return {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": RESUME_TOKENS, **params}}
    first = {"messages": [{"role": "user", "content": prompt}]} if path == ROUTES[0] else {"prompt": prompt}
    return {"model": "dsv4-tiny", **first, "stream": True, "max_tokens": RESUME_TOKENS,
            "stream_options": {"include_usage": True}, **params}


def _docs(raw: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def _text(path: str, raw: bytes) -> str:
    docs = _docs(raw)
    if path == "/generate":
        return docs[-1]["text"] if docs else ""
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for d in docs for c in d["choices"])


def _held_window(text: str) -> tuple[int, str]:
    """Where a long stop string starts in `text` and the string: 120 characters with a multi-byte one inside, found
    first at that place (so the worker holds the text back from there on)."""
    for start in range(24, len(text) - 130):
        stop = text[start:start + 120]
        if not stop.isascii() and text.find(stop) == start:
            return start, stop
    raise AssertionError(f"no multi-byte character in the greedy text: {text!r}")


def _one_stream(path: str, raw: bytes) -> bytes:
    """The stream with its id and created time taken out, after checking that it has one of each and one role chunk
    (what a client sees at the seam)."""
    docs = _docs(raw)
    ids = {d["meta_info"]["id"] if path == "/generate" else d["id"] for d in docs}
    created = {d["created"] for d in docs if "created" in d}
    roles = sum("role" in (c.get("delta") or {}) for d in docs for c in d.get("choices", []))
    one_role = roles == (path == ROUTES[0])
    assert len(ids) == 1 and len(created) == (path != "/generate") and one_role, (ids, created, roles)
    out = raw.replace(json.dumps(ids.pop()).encode(), b'"ID"')
    return re.sub(rb'"created":\d+', b'"created":0', out)


async def _streams(c: LocalCluster, bodies: list[tuple[str, dict]], fault=None) -> list[bytes]:
    """The bodies streamed at once; `fault(seen)` runs beside them, `seen` growing with each stream's bytes."""
    seen: list[list[bytes]] = [[] for _ in bodies]

    async def one(client: httpx.AsyncClient, k: int, path: str, body: dict) -> bytes:
        async with client.stream("POST", c.router_url + path, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for part in resp.aiter_raw():
                seen[k].append(part)
        return b"".join(seen[k])

    async with httpx.AsyncClient(timeout=120) as client:
        calls = [one(client, k, path, body) for k, (path, body) in enumerate(bodies)]
        results = await asyncio.gather(*calls, *([fault(seen)] if fault else []))
    return list(results[:len(bodies)])


def _flush_prefill(c: LocalCluster) -> None:
    """No prompt of an earlier run in the prefix cache: both runs report the same `cached_tokens`."""
    assert httpx.post(f"http://{HOST}:{c.ports['prefill']}/flush_cache", timeout=30).status_code == 200


def _router_migrations(c: LocalCluster) -> float:
    text = httpx.get(c.router_url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dsv4_router_migrations_total"))


def test_a_resumed_greedy_stream_is_byte_identical_to_the_uninterrupted_one(cluster: LocalCluster) -> None:
    """On chat, completions and /generate, a greedy stream whose only decode is killed (-9) while it holds text back
    (the start of a long stop string with a multi-byte character in it) is resumed on the restarted decode, and the
    client gets the bytes of the uninterrupted stream: text, chunks, token count, usage (cached_tokens too), ids,
    one role chunk. Per route, (a) the stop string matches in the resumed part, (b) it never does (it ends in a
    newline, which the model never writes), so the held text, multi-byte character included, comes out there."""
    wait_for(lambda: all(r["state"] == "READY" for r in status_rows(cluster).values()), 120, "all READY",
             interval_s=STATUS_POLL_S)
    plain = [(path, _resume_body(path, i)) for i, path in enumerate(ROUTES * 2)]
    texts = [_text(path, raw) for (path, _), raw in zip(plain, asyncio.run(_streams(cluster, plain)))]
    windows = [_held_window(t) for t in texts]
    bodies = [(path, _resume_body(path, i, stop if i < 3 else stop + "\n"))
              for i, ((path, _), (_, stop)) in enumerate(zip(plain, windows))]
    _flush_prefill(cluster)
    want = asyncio.run(_streams(cluster, bodies))
    assert [_text(p, w) for (p, _), w in zip(bodies, want)][:3] == [t[:s] for t, (s, _) in zip(texts[:3], windows)]
    _flush_prefill(cluster)
    pid, before = _pid(cluster, "decode-0"), status_rows(cluster)["decode-0"]["restarts"]
    migrations = _router_migrations(cluster)

    # what a client has once the model wrote up to the stop string's start: the worker holds the rest back
    shown = [start - held_back(text[:start], (stop,)) for text, (start, stop) in zip(texts, windows)]

    async def kill_while_held(seen: list[list[bytes]]) -> None:
        """Once every stream's text stands where its worker holds it back, 120 characters before it goes on."""
        def held() -> bool:
            return all(len(_text(p, b"".join(s))) >= n for (p, _), s, n in zip(bodies, seen, shown))
        await asyncio.to_thread(wait_for, held, 60, "every stream holding its text back", 0.005)
        os.kill(pid, signal.SIGKILL)

    got = asyncio.run(_streams(cluster, bodies, kill_while_held))
    for (path, _), g, w in zip(bodies, got, want):
        assert _one_stream(path, g) == _one_stream(path, w), (path, g[-600:], w[-600:])
    assert _router_migrations(cluster) - migrations == len(bodies), "every stream was resumed"
    _back(cluster, "decode-0", before + 1)
