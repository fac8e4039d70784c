"""The two processes of `bench/kv_transfer.py`: the prefill side (it drives and times) and the decode side.

    python -m bench.kv_transfer_sides decode  --port P --device cuda:1 ...
    python -m bench.kv_transfer_sides prefill --port P --device cuda:0 --peer-device cuda:1 --result F

Both sides build the engine's own pool (`RunnerConfig.layout()` -> `KVPool`, as `ModelRunner` does: the preset's
layers, page size, dtype: bf16 on CUDA, float32 on the CPU) and the engine's own `NixlTransfer` on it; the decode
side hands the prefill side its `PeerInfo`, as the bootstrap server's `/kv/register` does. They talk over one TCP
connection on loopback (JSON lines); the KV itself moves over NIXL/UCX.

Per request size, interleaved trial by trial (so a load spike on the machine hits all four alike):
- engine: `NixlTransfer.write_pages` of the pages the engine's allocator gives the prompt (`KVPool.alloc`, or in
  cache mode `PrefixCache.allocate`, on a pool in the state `--pages` asks for: kv_transfer_parts.side_pool) into
  the pages the decode pool's allocator gives, with `notif_message` as the notification; done when the prefill side's `poll` says DONE and the decode
  side's `notifications()` returned it (both sides poll without sleeping, where the engine loops poll every 1 ms:
  this measures the transfer, not the loops' cadence; times are CLOCK_MONOTONIC, one clock for every process of
  the host);
- runs (`--runs` only): the same pages through a second pair of agents that build a new descriptor list per
  request, one descriptor per region and run of pages (`NixlTransfer(descriptors="runs")`); the engine's own agents
  use lists prepared once per peer (its default). Without it each side registers its pool in one agent, as a worker
  does;
- raw: one NIXL WRITE of one contiguous region of the same bytes, one descriptor, between two other agents, with
  a notification, timed the same way;
- copy: `dst.copy_(src)` of the same bytes from the prefill device to the decode device (both synchronized).
Checks per size: the decode side zeroes its whole pool and raw region first (the prefill's values are never
zero); afterwards the non-zero bytes of its pool equal the request's pages' bytes and the SHA-256 of its
destination pages equals that of the prefill's source pages (the raw region likewise; the copy compared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dsv4_cluster.workers.prefill.destinations import notif_message
from dsv4_cluster.workers.kv.transfer import NixlTransfer, PeerInfo, page_runs
from .kv_transfer_parts import (PAGE_STATES, RawAgent, SideError, cache_alloc, max_bytes, nonzero_bytes, nonzero_random,
                                page_digest, region_digest, side_pool)

PREFILL_AGENT, DECODE_AGENT = "kvx-prefill", "kvx-decode"
RUNS_PREFILL_AGENT, RUNS_DECODE_AGENT = "kvx-runs-prefill", "kvx-runs-decode"
RAW_PREFILL_AGENT, RAW_DECODE_AGENT = "kvx-raw-prefill", "kvx-raw-decode"
CONNECT_TIMEOUT_S = 120.0


class Link:
    """JSON lines over one TCP connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def _lines(self) -> list[dict]:
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(x) for x in lines if x]

    def poll(self) -> list[dict] | None:
        """Messages that have arrived, without blocking; None once the peer closed."""
        if not select.select([self.sock], [], [], 0)[0]:
            return []
        data = self.sock.recv(1 << 16)
        if not data:
            return None
        self._buf += data
        return self._lines()

    def recv(self, timeout_s: float = 600.0) -> dict:
        self.sock.settimeout(timeout_s)
        while b"\n" not in self._buf:
            data = self.sock.recv(1 << 16)
            if not data:
                raise SideError("the decode side closed the connection (see its log)")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def _pin(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else f"cpu x{os.cpu_count()}"


def _sync(*devices: str) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(torch.device(d))


# ----------------------------------------------------------------------------------------------- decode side

def run_decode(a: argparse.Namespace) -> int:
    _pin(a.device)
    pool, state, _ = side_pool(a)
    transfer = NixlTransfer(DECODE_AGENT, pool, a.ucx_tls)
    runs = NixlTransfer(RUNS_DECODE_AGENT, pool, a.ucx_tls, descriptors="runs") if a.runs else None
    raw = RawAgent(RAW_DECODE_AGENT, max_bytes(pool, a.sizes), a.device)
    server = socket.create_server(("127.0.0.1", a.port))
    server.settimeout(CONNECT_TIMEOUT_S)
    conn, _ = server.accept()
    server.close()
    link = Link(conn)
    link.send({"engine": transfer.local_info().to_json(), "runs": runs.local_info().to_json() if runs else None,
               "raw": raw.info(), "pool_state": state})
    dst: list[int] = []
    while True:
        for kind, agent in (("engine", transfer), *((("runs", runs),) if runs else ())):
            for msg in agent.notifications():          # what DecodeEngine._receive reads
                t = time.monotonic()
                link.send({"ev": "notif", "kind": kind, "room": int(json.loads(msg)["room"]), "t": t})
        for msgs in raw.agent.get_new_notifs().values():
            t = time.monotonic()
            for msg in msgs:
                link.send({"ev": "notif", "kind": "raw", "room": int(msg), "t": t})
        cmds = link.poll()
        if cmds is None:
            return 0
        for cmd in cmds:
            op = cmd["op"]
            if op == "stop":
                link.send({"ev": "stopped"})
                return 0
            if op == "prepare":                       # the decode engine's allocator picks the pages
                dst = pool.alloc(cmd["tokens"])
                for b in pool.buffers():
                    b.zero_()
                raw.buf.zero_()
                _sync(a.device)
                link.send({"ev": "prepared", "dst": dst})
            elif op == "check":
                link.send({"ev": "checked", "digest": page_digest(pool, dst),
                           "written_bytes": nonzero_bytes(pool.buffers()),
                           "raw_digest": region_digest(raw.buf, cmd["raw_bytes"]),
                           "raw_written_bytes": nonzero_bytes([raw.buf])})
                pool.release(dst)
                dst = []


# ---------------------------------------------------------------------------------------------- prefill side

def _connect(port: int) -> Link:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Link(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            if time.monotonic() > deadline:
                raise SideError(f"the decode side never listened on 127.0.0.1:{port} (see its log)") from None
            time.sleep(0.2)


def _wait_notif(link: Link, kind: str, room: int) -> float:
    msg = link.recv()
    if msg.get("ev") != "notif" or msg.get("kind") != kind or msg.get("room") != room:
        raise SideError(f"expected the {kind} notification of room {room}, got {msg}")
    return msg["t"]


def _until_done(poll, handle, what: str) -> float:
    while (state := poll(handle)) == "PROC":
        pass
    if state != "DONE":
        raise SideError(f"the {what} WRITE ended {state}")
    return time.monotonic()


class PrefillSide:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        _pin(a.device)
        torch.manual_seed(a.seed)
        self.pool, self.pool_state, self.cache = side_pool(a)
        self.rng = random.Random(a.seed)
        for b in self.pool.buffers():                 # never zero, so the bytes written are countable
            b.copy_(nonzero_random(b))
        self.transfer = NixlTransfer(PREFILL_AGENT, self.pool, a.ucx_tls)
        self.runs = NixlTransfer(RUNS_PREFILL_AGENT, self.pool, a.ucx_tls, descriptors="runs") if a.runs else None
        nbytes = max_bytes(self.pool, a.sizes)
        self.raw = RawAgent(RAW_PREFILL_AGENT, nbytes, a.device)
        self.raw.buf.copy_(nonzero_random(self.raw.buf))
        self.copy_dst = torch.empty(nbytes, dtype=torch.uint8, device=a.peer_device)
        self.link = _connect(a.port)
        hello = self.link.recv(CONNECT_TIMEOUT_S)
        self.peer = PeerInfo.from_json(hello["engine"])
        self.incarnation = self.transfer.add_peer(self.peer)   # what the bootstrap server's /kv/register does
        self.runs_peer = PeerInfo.from_json(hello["runs"]) if a.runs else None
        if self.runs:
            self.runs.add_peer(self.runs_peer)
        self.decode_pool_state = hello["pool_state"]
        self.raw.add_peer(hello["raw"])
        self.room = 0

    def engine_trial(self, src: list[int], dst: list[int], kind: str = "engine") -> tuple[float, float]:
        self.room += 1
        agent, peer = (self.transfer, self.peer) if kind == "engine" else (self.runs, self.runs_peer)
        t0 = time.monotonic()
        handle = agent.write_pages(peer.agent_name, src, dst, notif_message(self.room, 0))
        done = _until_done(agent.poll, handle, kind)
        return done - t0, max(done, _wait_notif(self.link, kind, self.room)) - t0

    def raw_trial(self, nbytes: int) -> tuple[float, float]:
        self.room += 1
        t0 = time.monotonic()
        handle = self.raw.write(nbytes, str(self.room).encode())
        done = _until_done(self.raw.poll, handle, "raw")
        return done - t0, max(done, _wait_notif(self.link, "raw", self.room)) - t0

    def copy_trial(self, nbytes: int) -> float:
        _sync(self.a.device, self.a.peer_device)
        t0 = time.monotonic()
        self.copy_dst[:nbytes].copy_(self.raw.buf[:nbytes])
        _sync(self.a.device, self.a.peer_device)
        return time.monotonic() - t0

    def measure(self, tokens: int) -> dict:
        a, pool = self.a, self.pool
        # the prefill engine's allocator (in cache mode through its prefix cache, which makes room first)
        src = cache_alloc(self.cache, pool.pages_for(tokens), self.rng) if self.cache else pool.alloc(tokens)
        self.link.send({"op": "prepare", "tokens": tokens})
        dst = self.link.recv()["dst"]
        nbytes = len(src) * pool.page_bytes           # what PrefillEngine counts for the WRITE
        times: dict[str, list[float]] = {"engine": [], "engine_done": [], "runs": [], "runs_done": [],
                                         "raw": [], "raw_done": [], "copy": []}
        trials = {"engine": lambda: self.engine_trial(src, dst),
                  **({"runs": lambda: self.engine_trial(src, dst, "runs")} if self.runs else {}),
                  "raw": lambda: self.raw_trial(nbytes), "copy": lambda: (None, self.copy_trial(nbytes))}
        order = list(trials)
        for i in range(a.warmup + a.repeats):
            k = i % len(order)
            for name in order[k:] + order[:k]:    # each method goes first, second, ... in turn
                done, t = trials[name]()
                if i >= a.warmup:
                    times[name].append(t)
                    if done is not None:
                        times[f"{name}_done"].append(done)
        self.link.send({"op": "check", "raw_bytes": nbytes})
        seen = self.link.recv()
        checks = {
            "engine_written_bytes": seen["written_bytes"],
            "engine_contents_equal": seen["digest"] == page_digest(pool, src),
            "raw_written_bytes": seen["raw_written_bytes"],
            "raw_contents_equal": seen["raw_digest"] == region_digest(self.raw.buf, nbytes),
            "copy_contents_equal": bool(torch.equal(self.copy_dst[:nbytes].to(self.raw.buf.device),
                                                    self.raw.buf[:nbytes])),
        }
        pool.release(src)
        return {"tokens": tokens, "pages": len(src), "bytes": nbytes,
                "descriptors": {"engine": len(page_runs(src, dst)) * len(pool.regions()), "raw": 1},
                "run_lengths": {"src": [n for _, _, n in page_runs(src, src)],
                                "dst": [n for _, _, n in page_runs(dst, dst)]},
                "page_runs": {"src": len(page_runs(src, src)), "dst": len(page_runs(dst, dst)),
                              "both": len(page_runs(src, dst))},
                "times_s": times, "checks": checks}

    def layout(self) -> dict:
        pool, n = self.pool, self.pool.layout.num_pages
        return {"layout": asdict(pool.layout), "page_bytes": pool.page_bytes, "buffers": len(pool.buffers()),
                "regions": len(pool.regions()),
                "state": {"prefill": self.pool_state, "decode": self.decode_pool_state},
                "buffer_page_bytes": [b.numel() * b.element_size() // n for b in pool.buffers()],
                "buffer_dtypes": sorted({str(b.dtype).removeprefix("torch.") for b in pool.buffers()}),
                "device_names": [_device_name(d) for d in (self.a.device, self.a.peer_device)]}

    def close(self) -> None:
        self.link.send({"op": "stop"})
        self.link.recv()


def run_prefill(a: argparse.Namespace) -> int:
    side = PrefillSide(a)
    sizes = []
    for tokens in a.sizes:
        sizes.append(side.measure(tokens))
        print(f"[kv_transfer] {tokens} tokens measured", file=sys.stderr, flush=True)
    result = {"pool": side.layout(), "sizes": sizes}
    side.close()
    Path(a.result).write_text(json.dumps(result))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--pages", choices=PAGE_STATES, default="fresh",
                   help="the pools' state before the timed requests (see side_pool)")
    p.add_argument("--occupancy", type=float, default=0.9, help="churned pools: the share of pages held")
    p.add_argument("--runs", action="store_true", help="also time the runs agents (two agents per side)")
    p.add_argument("--churn-cycles", type=int, default=5000)
    p.add_argument("--result", help="prefill only: write the measurements here (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    return run_decode(a) if a.role == "decode" else run_prefill(a)


if __name__ == "__main__":
    raise SystemExit(main())
