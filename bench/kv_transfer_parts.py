"""What both sides of `bench/kv_transfer.py` build: the engine's own pool in the state `--pages` asks for (fresh,
churned, scattered), the raw NIXL agent it is compared with, and the byte checks (digests of pages, bytes
written)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import random

import numpy as np
import torch

from dsv4_cluster.workers.kv_pool import KVPool
from dsv4_cluster.workers.nixl_loader import load_nixl_api
from dsv4_cluster.workers.presets import model_config
from dsv4_cluster.workers.runner import RunnerConfig


def build_pool(preset: str, n_layers: int, page_size: int, pages: int, device: str) -> KVPool:
    """The engine's pool for the preset, as ModelRunner builds it (layout, dtype, device); n_layers 0: the
    preset's. A layout the engine refuses raises ValueError (KVPool's message)."""
    overrides = {"n_layers": n_layers} if n_layers else {}
    tokens = pages * page_size
    cfg = RunnerConfig(model=model_config(preset, **overrides), page_size=page_size, max_total_tokens=tokens,
                       context_length=tokens, device=device)
    return KVPool(cfg.layout(), device=device, dtype=cfg.dtype)


# mixed request sizes of the churn (those of at most a quarter of the pool)
CHURN_SIZES_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def side_pool(a: argparse.Namespace) -> tuple[KVPool, dict]:
    """This side's pool in the state `--pages` asks for, and what that state is (free runs, pages held):
    - fresh: nothing allocated yet;
    - churned: `--churn-cycles` allocate/free cycles of mixed sizes (the engine's own allocator, this side's
      seed), then half of what is still held freed: a long-running pool, with room for the timed requests;
    - scattered: every other page held, so every free run is one page (the worst case: what the deque free list
      handed out after churn)."""
    pool = build_pool(a.preset, a.n_layers, a.page_size, a.pool_pages, a.device)
    held: list[list[int]] = []
    if a.pages == "churned":
        rng = random.Random(f"{a.seed}-{a.role}")
        sizes = [t for t in CHURN_SIZES_TOKENS if pool.pages_for(t) * 4 <= a.pool_pages] or [a.page_size]
        for _ in range(a.churn_cycles):
            tokens = rng.choice(sizes)
            if held and (rng.random() < 0.45 or pool.pages_for(tokens) * 2 > sum(n for _, n in pool.free_runs)):
                pool.release(held.pop(rng.randrange(len(held))))
            else:
                held.append(pool.alloc(tokens))
        for _ in range(len(held) // 2):
            pool.release(held.pop(rng.randrange(len(held))))
    elif a.pages == "scattered":
        pages = pool.alloc(pool.capacity_tokens)
        pool.release(pages[::2])
        held.append(pages[1::2])
    runs = pool.free_runs
    state = {"pages": a.pages, "churn_cycles": a.churn_cycles if a.pages == "churned" else 0,
             "held_pages": sum(map(len, held)), "free_pages": sum(n for _, n in runs), "free_runs": len(runs),
             "longest_free_run": max((n for _, n in runs), default=0)}
    return pool, state


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
