"""The two processes of `bench/kv_transfer.py`: the prefill side (it drives and times) and the decode side.

    python -m bench.kv_transfer_sides decode|prefill --port P --device cuda:N ... (started by bench/kv_transfer.py)

Each builds the engine's own pool and `NixlTransfer` on it (kv_transfer_parts.side_pool); the decode side hands the
prefill side its `PeerInfo`, as the bootstrap server's `/kv/register` does. They talk over one loopback connection
(multiprocessing.connection); the KV moves over NIXL/UCX. Per request size, trial by trial in rotating order (a load
spike hits every method alike): engine (`write_pages` of the pages each side's allocator gave, with
`notif_message`, done when the prefill's `poll` says DONE and the decode's `notifications()` returned it; both
sides poll without sleeping: this times the transfer, not an engine loop's cadence), raw (one NIXL WRITE of one
contiguous region of the same bytes, with a notification), copy (`copy_` of the same bytes to the decode device).
Checks: the decode side zeroes its pool and raw region first (the prefill's values are never zero); afterwards its
pool's non-zero bytes equal the request's bytes and the SHA-256 of its destination pages equals the source pages'.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import torch

from dsv4_cluster.workers.prefill.destinations import notif_message
from dsv4_cluster.workers.transfer import NixlTransfer, PeerInfo, page_runs
from .kv_transfer_parts import (PAGE_STATES, RawAgent, SideError, cache_alloc, max_bytes, nonzero_bytes, nonzero_random,
                                page_digest, region_digest, side_pool)

PREFILL_AGENT, DECODE_AGENT = "kvx-prefill", "kvx-decode"
RAW_PREFILL_AGENT, RAW_DECODE_AGENT = "kvx-raw-prefill", "kvx-raw-decode"
CONNECT_TIMEOUT_S, AUTH = 120.0, b"kvx"


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(torch.device(d))


def run_decode(a: argparse.Namespace) -> int:
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    pool, state, _ = side_pool(a)
    transfer = NixlTransfer(DECODE_AGENT, pool, a.ucx_tls)
    raw = RawAgent(RAW_DECODE_AGENT, max_bytes(pool, a.sizes), a.device)
    with Listener(("127.0.0.1", a.port), authkey=AUTH) as listener:
        link = listener.accept()
    link.send({"engine": transfer.local_info().to_json(), "raw": raw.info(), "pool_state": state})
    dst: list[int] = []
    while True:
        for msg in transfer.notifications():          # what DecodeEngine._receive reads
            link.send({"ev": "notif", "kind": "engine", "room": int(json.loads(msg)["room"]), "t": time.monotonic()})
        for msgs in raw.agent.get_new_notifs().values():
            t = time.monotonic()
            for msg in msgs:
                link.send({"ev": "notif", "kind": "raw", "room": int(msg), "t": t})
        try:
            cmd = link.recv() if link.poll(0) else None
        except EOFError:
            return 0
        if cmd is None:
            continue
        if cmd["op"] == "stop":
            link.send({"ev": "stopped"})
            return 0
        if cmd["op"] == "prepare":                       # the decode engine's allocator picks the pages
            dst = pool.alloc(cmd["tokens"])
            for b in [*pool.buffers(), raw.buf]:
                b.zero_()
            _sync(a.device)
            link.send({"ev": "prepared", "dst": dst})
        elif cmd["op"] == "check":
            link.send({"ev": "checked", "digest": page_digest(pool, dst), "written_bytes": nonzero_bytes(pool.buffers()),
                       "raw_digest": region_digest(raw.buf, cmd["raw_bytes"]), "raw_written_bytes": nonzero_bytes([raw.buf])})
            pool.release(dst)
            dst = []


def _recv(link: Connection, timeout_s: float = 600.0) -> dict:
    if not link.poll(timeout_s):
        raise SideError(f"the decode side said nothing for {timeout_s:g} s (see its log)")
    try:
        return link.recv()
    except EOFError:
        raise SideError("the decode side closed the connection (see its log)") from None


class PrefillSide:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        if a.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(a.device))
        torch.manual_seed(a.seed)
        self.pool, self.pool_state, self.cache = side_pool(a)
        self.rng, self.room = random.Random(a.seed), 0
        for b in self.pool.buffers():                 # never zero, so the bytes written are countable
            b.copy_(nonzero_random(b))
        self.transfer = NixlTransfer(PREFILL_AGENT, self.pool, a.ucx_tls)
        nbytes = max_bytes(self.pool, a.sizes)
        self.raw = RawAgent(RAW_PREFILL_AGENT, nbytes, a.device)
        self.raw.buf.copy_(nonzero_random(self.raw.buf))
        self.copy_dst = torch.empty(nbytes, dtype=torch.uint8, device=a.peer_device)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self.link = Client(("127.0.0.1", a.port), authkey=AUTH)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SideError(f"the decode side never listened on 127.0.0.1:{a.port} (see its log)") from None
                time.sleep(0.2)
        hello = _recv(self.link, CONNECT_TIMEOUT_S)
        self.peer = PeerInfo.from_json(hello["engine"])
        self.transfer.add_peer(self.peer)   # what the bootstrap server's /kv/register does
        self.decode_pool_state = hello["pool_state"]
        self.raw.add_peer(hello["raw"])

    def _trial(self, start, poll, kind: str) -> tuple[float, float]:
        """(until the prefill's poll said DONE, until the decode side also had the notification), from the start."""
        self.room += 1
        t0 = time.monotonic()
        handle = start(self.room)
        while (state := poll(handle)) == "PROC":
            pass
        if state != "DONE":
            raise SideError(f"the {kind} WRITE ended {state}")
        done, msg = time.monotonic(), _recv(self.link)
        if msg.get("ev") != "notif" or msg.get("kind") != kind or msg.get("room") != self.room:
            raise SideError(f"expected the {kind} notification of room {self.room}, got {msg}")
        return done - t0, max(done, msg["t"]) - t0

    def copy_trial(self, nbytes: int) -> tuple[None, float]:
        _sync(self.a.device, self.a.peer_device)
        t0 = time.monotonic()
        self.copy_dst[:nbytes].copy_(self.raw.buf[:nbytes])
        _sync(self.a.device, self.a.peer_device)
        return None, time.monotonic() - t0

    def measure(self, tokens: int) -> dict:
        a, pool, transfer = self.a, self.pool, self.transfer
        # the prefill engine's allocator (in cache mode through its prefix cache, which makes room first)
        src = cache_alloc(self.cache, pool.pages_for(tokens), self.rng) if self.cache else pool.alloc(tokens)
        self.link.send({"op": "prepare", "tokens": tokens})
        dst, nbytes = _recv(self.link)["dst"], len(src) * pool.page_bytes   # what PrefillEngine counts for the WRITE
        trials = {"engine": lambda: self._trial(lambda room: transfer.write_pages(
                      self.peer.agent_name, src, dst, notif_message(room, 0)), transfer.poll, "engine"),
                  "raw": lambda: self._trial(lambda room: self.raw.write(nbytes, str(room).encode()), self.raw.poll,
                                             "raw"),
                  "copy": lambda: self.copy_trial(nbytes)}
        times: dict[str, list[float]] = {k: [] for k in ("engine", "engine_done", "raw", "raw_done", "copy")}
        order = list(trials)
        for i in range(a.warmup + a.repeats):
            for name in order[i % 3:] + order[:i % 3]:    # each method goes first, second, ... in turn
                done, t = trials[name]()
                if i >= a.warmup:
                    times[name].append(t)
                    if done is not None:
                        times[f"{name}_done"].append(done)
        self.link.send({"op": "check", "raw_bytes": nbytes})
        seen = _recv(self.link)
        checks = {"engine_written_bytes": seen["written_bytes"],
                  "engine_contents_equal": seen["digest"] == page_digest(pool, src),
                  "raw_written_bytes": seen["raw_written_bytes"],
                  "raw_contents_equal": seen["raw_digest"] == region_digest(self.raw.buf, nbytes),
                  "copy_contents_equal": bool(torch.equal(self.copy_dst[:nbytes].to(self.raw.buf.device),
                                                          self.raw.buf[:nbytes]))}
        pool.release(src)
        return {"tokens": tokens, "pages": len(src), "bytes": nbytes,
                "descriptors": {"engine": len(page_runs(src, dst)) * len(pool.regions()), "raw": 1},
                "run_lengths": {"src": [n for _, _, n in page_runs(src, src)], "dst": [n for _, _, n in page_runs(dst, dst)]},
                "page_runs": {"src": len(page_runs(src, src)), "dst": len(page_runs(dst, dst)),
                              "both": len(page_runs(src, dst))}, "times_s": times, "checks": checks}

    def layout(self) -> dict:
        pool, n = self.pool, self.pool.layout.num_pages
        name = lambda d: torch.cuda.get_device_name(torch.device(d)) if d.startswith("cuda") else f"cpu x{os.cpu_count()}"  # noqa: E731
        return {"layout": asdict(pool.layout), "page_bytes": pool.page_bytes, "buffers": len(pool.buffers()),
                "regions": len(pool.regions()), "state": {"prefill": self.pool_state, "decode": self.decode_pool_state},
                "buffer_page_bytes": [b.numel() * b.element_size() // n for b in pool.buffers()],
                "buffer_dtypes": sorted({str(b.dtype).removeprefix("torch.") for b in pool.buffers()}),
                "device_names": [name(d) for d in (self.a.device, self.a.peer_device)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one side of bench/kv_transfer.py (started by it)")
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--port", type=int, required=True, help="the decode side listens here (loopback)")
    p.add_argument("--device", default="cpu", help="this side's device: cpu or cuda:N")
    p.add_argument("--peer-device", default="cpu", help="prefill only: the decode side's device (the copy's target)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
    p.add_argument("--preset", default="flash")
    p.add_argument("--n-layers", type=int, default=0, help="override the preset's layers (0: the preset's)")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--pool-pages", type=int, required=True)
    p.add_argument("--ucx-tls")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pages", choices=PAGE_STATES, default="fresh", help="the pools' state (see side_pool)")
    p.add_argument("--occupancy", type=float, default=0.9, help="churned pools: the share of pages held")
    p.add_argument("--churn-cycles", type=int, default=5000)
    p.add_argument("--result", help="prefill only: write the measurements here (JSON)")
    a = p.parse_args(argv)
    if a.role == "decode":
        return run_decode(a)
    side = PrefillSide(a)
    sizes = []
    for tokens in a.sizes:
        sizes.append(side.measure(tokens))
        print(f"[kv_transfer] {tokens} tokens measured", file=sys.stderr, flush=True)
    side.link.send({"op": "stop"})
    _recv(side.link)
    Path(a.result).write_text(json.dumps({"pool": side.layout(), "sizes": sizes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
