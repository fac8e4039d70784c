"""The two processes of `bench/kv_transfer.py`: the prefill side (it drives and times) and the decode side.

    python -m dsv4_cluster.bench.kv_transfer_sides decode  --port P --device cuda:1 ...
    python -m dsv4_cluster.bench.kv_transfer_sides prefill --port P --device cuda:0 --peer-device cuda:1 --result F

Both sides build the engine's own pool (`RunnerConfig.layout()` -> `KVPool`, as `ModelRunner` does: the preset's
layers, page size, dtype: bf16 on CUDA, float32 on the CPU) and the engine's own `NixlTransfer` on it; the decode
side hands the prefill side its `PeerInfo`, as the bootstrap server's `/kv/register` does. They talk over one TCP
connection on loopback (JSON lines); the KV itself moves over NIXL/UCX.

Per request size, interleaved trial by trial (so a load spike on the machine hits all three alike):
- engine: `NixlTransfer.write_pages` of the pages the engine's allocator gives the prompt (`KVPool.alloc`) into the
  pages the decode pool's allocator gives, with `notif_message` as the notification; done when the prefill side's
  `poll` says DONE and the decode side's `notifications()` returned it (both sides poll without sleeping, where the
  engine loops poll every 1 ms: this measures the transfer, not the loops' cadence; times are CLOCK_MONOTONIC, one
  clock for every process of the host);
- raw: one NIXL WRITE of one contiguous region of the same bytes, one descriptor, between two other agents, with
  a notification, timed the same way;
- copy: `dst.copy_(src)` of the same bytes from the prefill device to the decode device (both synchronized).
Checks per size: the decode side zeroes its whole pool and raw region first (the prefill's values are never
zero); afterwards the non-zero bytes of its pool equal the request's pages' bytes and the SHA-256 of its
destination pages equals that of the prefill's source pages (the raw region likewise; the copy compared).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import select
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..workers.kv_pool import KVPool
from ..workers.nixl_loader import load_nixl_api
from ..workers.prefill.engine import notif_message
from ..workers.presets import model_config
from ..workers.runner import RunnerConfig
from ..workers.transfer import NixlTransfer, PeerInfo, page_runs

PREFILL_AGENT, DECODE_AGENT = "kvx-prefill", "kvx-decode"
RAW_PREFILL_AGENT, RAW_DECODE_AGENT = "kvx-raw-prefill", "kvx-raw-decode"
CONNECT_TIMEOUT_S = 120.0


class SideError(RuntimeError):
    """The other side went away, answered out of protocol, or a transfer failed."""


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


class RawAgent:
    """A NIXL agent (same config as the engine's: UCX, no progress thread) with one contiguous region."""

    def __init__(self, name: str, nbytes: int, device: str):
        api = load_nixl_api()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.agent.register_memory([self.buf])
        self.mem = "VRAM" if self.buf.device.type == "cuda" else "DRAM"
        self.dev = self.buf.device.index or 0
        self.peer: dict | None = None

    def info(self) -> dict:
        return {"name": self.agent.name, "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "addr": self.buf.data_ptr(), "mem": self.mem, "dev": self.dev}

    def add_peer(self, info: dict) -> None:
        self.agent.add_remote_agent(base64.b64decode(info["meta"]))
        self.peer = info

    def write(self, nbytes: int, notif: bytes):
        p = self.peer
        local = np.array([[self.buf.data_ptr(), nbytes, self.dev]], dtype=np.uint64)
        remote = np.array([[p["addr"], nbytes, p["dev"]]], dtype=np.uint64)
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.mem),
                                            self.agent.get_xfer_descs(remote, p["mem"]), p["name"], notif)
        if self.agent.transfer(handle) == "ERR":
            raise SideError(f"NIXL refused the raw WRITE of {nbytes} bytes")
        return handle

    def poll(self, handle) -> str:
        state = self.agent.check_xfer_state(handle)
        if state != "PROC":
            self.agent.release_xfer_handle(handle)
        return state


def build_pool(preset: str, n_layers: int, page_size: int, pages: int, device: str) -> KVPool:
    """The engine's pool for the preset, as ModelRunner builds it (layout, dtype, device); n_layers 0: the
    preset's. A layout the engine refuses raises ValueError (KVPool's message)."""
    overrides = {"n_layers": n_layers} if n_layers else {}
    tokens = pages * page_size
    cfg = RunnerConfig(model=model_config(preset, **overrides), page_size=page_size, max_total_tokens=tokens,
                       context_length=tokens, device=device)
    return KVPool(cfg.layout(), device=device, dtype=cfg.dtype)


def side_pool(a: argparse.Namespace) -> KVPool:
    pool = build_pool(a.preset, a.n_layers, a.page_size, a.pool_pages, a.device)
    if a.fragmented:       # a pool after churn: its free list in random order, so requests get scattered pages
        pages = pool.alloc(pool.capacity_tokens)
        random.Random(f"{a.seed}-{a.role}").shuffle(pages)
        pool.release(pages)
    return pool


def max_bytes(pool: KVPool, sizes: list[int]) -> int:
    return max(pool.pages_for(t) for t in sizes) * pool.page_bytes


def page_digest(pool: KVPool, pages: list[int]) -> str:
    """SHA-256 of `pages`' bytes in every buffer, buffer-major (the descriptors' order)."""
    h = hashlib.sha256()
    idx = torch.tensor(pages, device=pool.main[0].device)
    for b in pool.buffers():
        h.update(b.view(pool.layout.num_pages, -1).index_select(0, idx).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def region_digest(buf: torch.Tensor, nbytes: int) -> str:
    return hashlib.sha256(buf[:nbytes].cpu().numpy()).hexdigest()


def nonzero_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(int(torch.count_nonzero(t)) * t.element_size() for t in tensors)


def _nonzero_random(b: torch.Tensor) -> torch.Tensor:
    """Random values, none of them zero: floats in [1, 2), bytes in 1..255 (fp8 pages are uint8)."""
    if b.dtype.is_floating_point:
        return torch.rand(b.shape, device=b.device, dtype=torch.float32) + 1
    return torch.randint(1, 256, b.shape, device=b.device, dtype=torch.uint8)


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
    pool = side_pool(a)
    transfer = NixlTransfer(DECODE_AGENT, pool, a.ucx_tls)
    raw = RawAgent(RAW_DECODE_AGENT, max_bytes(pool, a.sizes), a.device)
    server = socket.create_server(("127.0.0.1", a.port))
    server.settimeout(CONNECT_TIMEOUT_S)
    conn, _ = server.accept()
    server.close()
    link = Link(conn)
    link.send({"engine": transfer.local_info().to_json(), "raw": raw.info()})
    dst: list[int] = []
    while True:
        for msg in transfer.notifications():          # what DecodeEngine._receive reads
            t = time.monotonic()
            link.send({"ev": "notif", "kind": "engine", "room": int(json.loads(msg)["room"]), "t": t})
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
        self.pool = side_pool(a)
        for b in self.pool.buffers():                 # never zero, so the bytes written are countable
            b.copy_(_nonzero_random(b))
        self.transfer = NixlTransfer(PREFILL_AGENT, self.pool, a.ucx_tls)
        nbytes = max_bytes(self.pool, a.sizes)
        self.raw = RawAgent(RAW_PREFILL_AGENT, nbytes, a.device)
        self.raw.buf.copy_(_nonzero_random(self.raw.buf))
        self.copy_dst = torch.empty(nbytes, dtype=torch.uint8, device=a.peer_device)
        self.link = _connect(a.port)
        hello = self.link.recv(CONNECT_TIMEOUT_S)
        self.peer = PeerInfo.from_json(hello["engine"])
        self.incarnation = self.transfer.add_peer(self.peer)   # what the bootstrap server's /kv/register does
        self.raw.add_peer(hello["raw"])
        self.room = 0

    def engine_trial(self, src: list[int], dst: list[int]) -> tuple[float, float]:
        self.room += 1
        t0 = time.monotonic()
        handle = self.transfer.write_pages(self.peer.agent_name, src, dst, notif_message(self.room, 0),
                                           self.incarnation)
        done = _until_done(self.transfer.poll, handle, "engine")
        return done - t0, max(done, _wait_notif(self.link, "engine", self.room)) - t0

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
        src = pool.alloc(tokens)                      # the prefill engine's allocator
        self.link.send({"op": "prepare", "tokens": tokens})
        dst = self.link.recv()["dst"]
        nbytes = len(src) * pool.page_bytes           # what PrefillEngine counts for the WRITE
        times: dict[str, list[float]] = {"engine": [], "engine_done": [], "raw": [], "raw_done": [], "copy": []}
        trials = {"engine": lambda: self.engine_trial(src, dst), "raw": lambda: self.raw_trial(nbytes),
                  "copy": lambda: (None, self.copy_trial(nbytes))}
        order = list(trials)
        for i in range(a.warmup + a.repeats):
            for name in order[i % 3:] + order[: i % 3]:    # each method goes first, second, third in turn
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
                "descriptors": {"engine": len(page_runs(src, dst)) * len(pool.buffers()), "raw": 1},
                "page_runs": {"src": len(page_runs(src, src)), "dst": len(page_runs(dst, dst)),
                              "both": len(page_runs(src, dst))},
                "times_s": times, "checks": checks}

    def layout(self) -> dict:
        pool, n = self.pool, self.pool.layout.num_pages
        return {"layout": asdict(pool.layout), "page_bytes": pool.page_bytes, "buffers": len(pool.buffers()),
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
    p.add_argument("--fragmented", action="store_true", help="shuffle the pool's free list first (scattered pages)")
    p.add_argument("--result", help="prefill only: write the measurements here (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    return run_decode(a) if a.role == "decode" else run_prefill(a)


if __name__ == "__main__":
    raise SystemExit(main())
