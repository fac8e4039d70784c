"""What both sides of `bench/kv_transfer.py` build: the engine's own pool in the state `--pages` asks for (fresh,
churned, scattered, cache), the raw NIXL agent it is compared with, and the byte checks (digests of pages, bytes
written)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import random

import numpy as np
import torch

from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
from dsv4_cluster.workers.kv.nixl_loader import load_nixl_api
from dsv4_cluster.workers.kv.prefix_cache import PrefixCache
from dsv4_cluster.workers.engine.presets import model_config
from dsv4_cluster.workers.engine.runner import RunnerConfig


def build_pool(preset: str, n_layers: int, page_size: int, pages: int, device: str) -> KVPool:
    """The engine's pool for the preset, as ModelRunner builds it (layout, dtype, device); n_layers 0: the
    preset's. A layout the engine refuses raises ValueError (KVPool's message)."""
    overrides = {"n_layers": n_layers} if n_layers else {}
    tokens = pages * page_size
    cfg = RunnerConfig(model=model_config(preset, **overrides), page_size=page_size, max_total_tokens=tokens,
                       context_length=tokens, device=device)
    return KVPool(cfg.layout(), device=device, dtype=cfg.dtype)


PAGE_STATES = ("fresh", "churned", "scattered", "cache")


def side_pool(a: argparse.Namespace) -> tuple[KVPool, dict, PrefixCache | None]:
    """This side's pool in the state `--pages` asks for, what that state is (free runs, pages held), and, in cache
    mode on the prefill side, the prefix cache whose `allocate` gives the timed requests their pages:
    - fresh: nothing allocated yet;
    - churned: `--churn-cycles` allocate/free cycles of arbitrary sizes (1 page to 1/8 of the pool; the engine's
      own allocator, this side's seed) around `--occupancy` of the pool, left at that occupancy;
    - scattered: every other page held, so every free run is one page (the worst case: what the deque free list
      handed out after churn);
    - cache: the prefill side's pool full of a prefix cache's pages after multi-turn chat (`kv_cache_churn.py`,
      the engine's own `PrefixCache`, which makes room for each timed request); the decode side churned."""
    pool = build_pool(a.preset, a.n_layers, a.page_size, a.pool_pages, a.device)
    held: list[list[int]] = []
    cache = None
    if a.pages == "cache" and a.role == "prefill":
        cache = prefix_cache_state(pool, a.churn_cycles, a.seed)
    elif a.pages in ("churned", "cache"):
        held = churn(pool, a.churn_cycles, a.occupancy, random.Random(f"{a.seed}-{a.role}"))
    elif a.pages == "scattered":
        pages = pool.alloc(pool.capacity_tokens)
        pool.release(pages[::2])
        held.append(pages[1::2])
    runs = pool.free_runs
    free = sum(n for _, n in runs)
    state = {"pages": a.pages, "churn_cycles": a.churn_cycles if a.pages != "fresh" else 0,
             "held_pages": pool.layout.num_pages - free, "free_pages": free, "free_runs": len(runs),
             "occupancy": round(1 - free / pool.layout.num_pages, 3),
             "longest_free_run": max((n for _, n in runs), default=0)}
    return pool, state, cache


def churn(pool: KVPool, cycles: int, occupancy: float, rng: random.Random) -> list[list[int]]:
    """Allocate and free requests of arbitrary sizes (1 page to 1/8 of the pool) around `occupancy`, then free or
    allocate until the pool is held at `occupancy` or just under; returns the pages held, per request."""
    n, ps = pool.layout.num_pages, pool.layout.page_size
    target, held = int(n * occupancy), []

    def used() -> int:
        return n - pool.free_pages

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
    """The pool full of a prefix cache's pages after `requests` turns of multi-turn chat. The workload runs on a
    16-token-page copy of the pool's allocator (token lists of 256-token pages would cost minutes of Python; what
    the cache does is the same per page), which the pool then uses: the timed requests' pages come from it."""
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


CACHE_PAGE = 16


def cache_alloc(cache: PrefixCache, pages: int, rng: random.Random) -> list[int]:
    """A timed request's `pages` through the prefix cache: a new prompt (nothing cached) of that many pages, room
    made as the prefill engine makes it; they go back with `pool.release` (never inserted). Its tokens lie above
    the workload's (0-255), so none of it is ever in the tree."""
    got = cache.allocate([256 + rng.randrange(1 << 20) for _ in range(pages * CACHE_PAGE)])
    if got is None:
        raise SideError(f"the prefix cache could not make room for {pages} pages")
    return got[1]


def max_bytes(pool: KVPool, sizes: list[int]) -> int:
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
