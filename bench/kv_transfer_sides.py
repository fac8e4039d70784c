"""The two processes of `bench/kv_transfer.py` (which starts them): the prefill side drives and times, the decode side
answers. Each builds the engine's own pool (`side_pool`, in the state `--pages` asks for) and `NixlTransfer` on it;
the decode side hands the prefill side its `PeerInfo` as the bootstrap server's `/kv/register` does; they talk over
one loopback connection, the KV moves over NIXL/UCX. Per request size, trial by trial in rotating order: engine
(`write_pages` of the pages each allocator gave, done when the prefill's `poll` says DONE and the decode has the
notification; both sides poll without sleeping), raw (one NIXL WRITE of one region), copy (`copy_` to the decode). Checks: the decode side zeroes its pool first (the prefill's values are never zero);
afterwards its non-zero bytes equal the request's and its destination pages' SHA-256 equals the source pages'.
With NIXL_TELEMETRY_ENABLE=y each WRITE's NIXL telemetry (post and post-to-done us, descriptors) is kept per trial.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import numpy as np
import torch

from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
from dsv4_cluster.workers.kv.nixl_loader import load_nixl_api
from dsv4_cluster.workers.prefill.destinations import notif_message
from dsv4_cluster.workers.kv.prefix_cache import PrefixCache
from dsv4_cluster.workers.engine.presets import model_config
from dsv4_cluster.workers.engine.runner import RunnerConfig
from dsv4_cluster.workers.kv.transfer import NixlTransfer, PeerInfo, page_runs, xfer_telemetry

PREFILL_AGENT, DECODE_AGENT = "kvx-prefill", "kvx-decode"
RAW_PREFILL_AGENT, RAW_DECODE_AGENT = "kvx-raw-prefill", "kvx-raw-decode"
CONNECT_TIMEOUT_S, AUTH = 120.0, b"kvx"
PAGE_STATES, CACHE_PAGE = ("fresh", "churned", "scattered", "cache"), 16   # --pages; the prefix cache's page tokens
TELEMETRY_ON = os.environ.get("NIXL_TELEMETRY_ENABLE", "").lower() in ("y", "yes", "1", "on", "true")
TELEMETRY_KEYS = {"post_us": "postDuration", "xfer_us": "xferDuration", "descs": "descCount"}   # times_s's: NIXL's


def build_pool(preset: str, n_layers: int, page_size: int, pages: int, device: str) -> KVPool:
    """The engine's pool for the preset as ModelRunner builds it (n_layers 0: the preset's); ValueError if refused."""
    tokens = pages * page_size
    cfg = RunnerConfig(model=model_config(preset, **({"n_layers": n_layers} if n_layers else {})), page_size=page_size,
                       max_total_tokens=tokens, context_length=tokens, device=device)
    return KVPool(cfg.layout(), device=device, dtype=cfg.dtype)


def side_pool(a: argparse.Namespace) -> tuple[KVPool, dict, PrefixCache | None]:
    """This side's pool in the state `--pages` asks for (fresh; churned, `churn`; scattered, every other page held;
    cache, the prefill's full of a prefix cache, the decode's churned), that state, and the prefill's prefix cache.
    The side's CUDA device (if any) is made current first."""
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    pool = build_pool(a.preset, a.n_layers, a.page_size, a.pool_pages, a.device)
    cache = None
    if a.pages == "cache" and a.role == "prefill":
        cache = prefix_cache_state(pool, a.churn_cycles, a.seed)
    elif a.pages in ("churned", "cache"):
        churn(pool, a.churn_cycles, a.occupancy, random.Random(f"{a.seed}-{a.role}"))
    elif a.pages == "scattered":
        pool.release(pool.alloc(pool.capacity_tokens)[::2])
    runs = pool.free_runs
    free = sum(n for _, n in runs)
    return pool, {"pages": a.pages, "churn_cycles": a.churn_cycles if a.pages != "fresh" else 0,
                  "held_pages": pool.layout.num_pages - free, "free_pages": free, "free_runs": len(runs),
                  "occupancy": round(1 - free / pool.layout.num_pages, 3),
                  "longest_free_run": max((n for _, n in runs), default=0)}, cache


def churn(pool: KVPool, cycles: int, occupancy: float, rng: random.Random) -> list[list[int]]:
    """Allocate and free requests of 1 page to 1/8 of the pool around `occupancy`, then free or allocate until the
    pool is held at `occupancy` or just under; returns the pages held, per request."""
    n, ps = pool.layout.num_pages, pool.layout.page_size
    target, held, used = int(n * occupancy), [], lambda: n - pool.free_pages
    for _ in range(cycles):
        pages = rng.randint(1, max(1, n // 8))
        if held and (used() + pages > target or rng.random() < 0.3):
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            held.append(pool.alloc(pages * ps))
    while used() > target:
        pool.release(held.pop(rng.randrange(len(held))))
    if target > used():
        held.append(pool.alloc((target - used()) * ps))
    return held


def prefix_cache_state(pool: KVPool, requests: int, seed: int) -> PrefixCache:
    """The pool full of a prefix cache's pages after `requests` chat turns, run on a 16-token-page copy of the pool's
    allocator (256-token pages' token lists would cost minutes; per page it is the same), which the pool then takes."""
    from .kv_cache_churn import Workload, run
    shadow = KVPool(PoolLayout(page_size=CACHE_PAGE, num_pages=pool.layout.num_pages, n_layers=1, head_dim=4,
                               index_dim=4, ratio=4, dtype="float32"), device="meta")
    tokens = pool.layout.num_pages * CACHE_PAGE       # the default workload's sizes, cut to fit a small pool
    w = Workload(pages=pool.layout.num_pages, requests=requests, warmup=0, seed=seed,
                 system_tokens=min(1000, tokens // 16), turn_tokens=(20, max(40, min(600, tokens // 16))),
                 max_context=min(8192, tokens // 4))
    cache, _ = run(w, shadow)
    pool._free = shadow._free    # one allocator: the cache's pages are the pool's (page indices are what matter)
    return cache


def cache_alloc(cache: PrefixCache, pages: int, rng: random.Random, follow: list[int] | None) -> list[int]:
    """A timed request's `pages` through the prefix cache, room made as the prefill engine makes it (its tokens lie
    above the workload's 0-255: never cached); they go back with `pool.release`."""
    got = cache.allocate([256 + rng.randrange(1 << 20) for _ in range(pages * CACHE_PAGE)], follow)
    if got is None:
        raise SideError(f"the prefix cache could not make room for {pages} pages")
    return got[1]


def max_bytes(pool: KVPool, sizes: list[int]) -> int:  # the raw region and the copy: the largest request's bytes
    return max(pool.pages_for(t) for t in sizes) * pool.page_bytes


def page_digest(pool: KVPool, pages: list[int]) -> str:
    """SHA-256 of `pages`' bytes in every buffer, buffer-major (the descriptors' order)."""
    h = hashlib.sha256()
    idx = torch.tensor(pages, device=pool.main[0].device)
    for b in pool.buffers():
        h.update(b.reshape(pool.layout.num_pages, -1).index_select(0, idx).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def region_digest(buf: torch.Tensor, nbytes: int) -> str:
    return hashlib.sha256(buf[:nbytes].cpu().numpy()).hexdigest()


def nonzero_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(int(torch.count_nonzero(t)) * t.element_size() for t in tensors)


def nonzero_random(b: torch.Tensor) -> torch.Tensor:
    """Random values, none of them zero: floats in [1, 2), bytes in 1..255 (fp8 pages are uint8)."""
    if b.dtype.is_floating_point:
        return torch.rand(b.shape, device=b.device, dtype=torch.float32) + 1
    return torch.randint(1, 256, b.shape, device=b.device, dtype=torch.uint8)


class SideError(RuntimeError):
    """The other side went away, answered out of protocol, or a transfer failed."""


class RawAgent:
    """A NIXL agent (same config as the engine's: UCX, no progress thread) with one contiguous region."""

    def __init__(self, name: str, nbytes: int, device: str):
        api = load_nixl_api()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.agent.register_memory([self.buf])
        self.mem, self.dev = "VRAM" if self.buf.device.type == "cuda" else "DRAM", self.buf.device.index or 0
        self.peer: dict | None = None

    def info(self) -> dict:
        return {"name": self.agent.name, "meta": self.agent.get_agent_metadata(), "addr": self.buf.data_ptr(),
                "mem": self.mem, "dev": self.dev}

    def add_peer(self, info: dict) -> None:
        self.agent.add_remote_agent(info["meta"])
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

    def poll(self, handle, telemetry=None) -> str:   # telemetry: as NixlTransfer.poll's
        state = self.agent.check_xfer_state(handle)
        if state != "PROC":
            if telemetry is not None:
                telemetry(xfer_telemetry(self.agent, handle))
            self.agent.release_xfer_handle(handle)
        return state


def _sync(*devices: str) -> None:
    for d in (d for d in devices if d.startswith("cuda")):
        torch.cuda.synchronize(torch.device(d))


def run_decode(a: argparse.Namespace) -> int:
    pool, state, _ = side_pool(a)
    transfer = NixlTransfer(DECODE_AGENT, pool, a.ucx_tls)
    raw = RawAgent(RAW_DECODE_AGENT, max_bytes(pool, a.sizes), a.device)
    with Listener(("127.0.0.1", a.port), authkey=AUTH) as listener:   # the prefill side connects
        link = listener.accept()
    link.send({"engine": transfer.local_info().to_json(), "raw": raw.info(), "pool_state": state})
    while True:
        for msg in transfer.notifications():          # what DecodeEngine._receive reads
            link.send({"ev": "notif", "kind": "engine", "room": int(json.loads(msg)["room"]), "t": time.monotonic()})
        for msg in (m for msgs in raw.agent.get_new_notifs().values() for m in msgs):
            link.send({"ev": "notif", "kind": "raw", "room": int(msg), "t": time.monotonic()})
        try:
            cmd = link.recv() if link.poll(0) else {"op": None}
        except EOFError:
            return 0
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
            with contextlib.suppress(OSError):
                self.link = Client(("127.0.0.1", a.port), authkey=AUTH)
                break
            if time.monotonic() > deadline:
                raise SideError(f"the decode side never listened on 127.0.0.1:{a.port} (see its log)")
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

    def _prepare(self, tokens: int) -> list[int]:
        self.link.send({"op": "prepare", "tokens": tokens})   # the decode engine's allocator picks the pages
        return _recv(self.link)["dst"]

    def measure(self, tokens: int) -> dict:
        a, pool, transfer = self.a, self.pool, self.transfer
        # the engine's allocators (cache: the prefill's prefix cache makes room); decode-first: src follows dst's runs
        dst = self._prepare(tokens) if a.order == "decode-first" else None
        src = cache_alloc(self.cache, pool.pages_for(tokens), self.rng, dst) if self.cache else pool.alloc(tokens, dst)
        dst = dst or self._prepare(tokens)
        nbytes = len(src) * pool.page_bytes   # what PrefillEngine counts for the WRITE
        tele: dict[str, dict | None] = {}    # NIXL telemetry of each kind's last WRITE (TELEMETRY_ON)
        poll = {k: functools.partial(p, telemetry=functools.partial(tele.__setitem__, k)) if TELEMETRY_ON else p
                for k, p in (("engine", transfer.poll), ("raw", self.raw.poll))}
        trials = {"engine": lambda: self._trial(lambda room: transfer.write_pages(
                      self.peer.agent_name, src, dst, notif_message(room, 0)), poll["engine"], "engine"),
                  "raw": lambda: self._trial(lambda room: self.raw.write(nbytes, str(room).encode()), poll["raw"], "raw"),
                  "copy": lambda: self.copy_trial(nbytes)}
        times: dict[str, list] = {k: [] for k in ("engine", "engine_done", "raw", "raw_done", "copy")}
        order = list(trials)
        for i in range(a.warmup + a.repeats):
            for name in order[i % 3:] + order[:i % 3]:    # each method goes first, second, ... in turn
                done, t = trials[name]()
                if i >= a.warmup:
                    times[name].append(t)
                    if done is not None:
                        times[f"{name}_done"].append(done)
                    for key, field in TELEMETRY_KEYS.items() if name in tele else ():   # tele None: NIXL kept none
                        times.setdefault(f"{name}_{key}", []).append(tele[name] and tele[name][field])
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
    """One side; its settings (JSON, the only argument) are bench/kv_transfer.py's, see run_sides."""
    a = argparse.Namespace(**json.loads((argv or sys.argv[1:])[0]))
    if a.role == "decode":
        return run_decode(a)
    side, sizes = PrefillSide(a), []
    for tokens in a.sizes:
        sizes.append(side.measure(tokens))
        print(f"[kv_transfer] {tokens} tokens measured", file=sys.stderr, flush=True)
    side.link.send({"op": "stop"})
    _recv(side.link)
    Path(a.result).write_text(json.dumps({"pool": side.layout(), "sizes": sizes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
