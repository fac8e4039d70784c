"""Where the host time of one engine WRITE goes: `NixlTransfer.write_pages` and `poll`, piece by piece.

    timeout 300 python -m bench.kv_write_host [--pages 4,32,128,512] [--reps 300] [--layout tiny|tiny-float|fp8|float]
        [--device cpu|cuda:0]

Two processes, as bench/kv_transfer_sides.py: this one (prefill) times, a child (decode) only reads notifications,
without sleeping (as there: a sleeping decode side delays the WRITE's completion and slows the host's pieces).
Both build a pool of the engine's layout (flash preset, 4 layers, 256-token pages; fp8: one region per pool, as on
a GPU; float: one region per buffer, as on the CPU) and the engine's `NixlTransfer` on it. Per page count, `--reps`
rounds, each: the pieces of `write_pages` run one by one with a clock between them, the transfer spun to DONE, the
pieces of `poll` (the lock, `check_xfer_state`, the release); then the whole `write_pages` and the releasing `poll`
as calls; bench/kv_transfer_sides.py's raw WRITE and poll (one descriptor: region 0's bytes of the same pages,
all their bytes in a one-region layout). Then `make_prepped_xfer` alone (made and released, never posted) with the
indices as an int32 array, an int64 array, a list, and as one index a region of a prepared list of whole-request
descriptors (the same bytes). Medians in us.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from dsv4_cluster.workers.kv.pool import KVPool
from dsv4_cluster.workers.kv.transfer import NixlTransfer, XferState, _check_pages, _indices, _strided

PAGE_COUNTS = (4, 32, 128, 512)


LAYOUTS = {  # name: (PoolLayout fields over the flash preset's, 4 layers, 256-token pages)
    "fp8": {"dtype": "fp8_e4m3"},                              # 694,272 B a page in one region (the GPU's)
    "float": {},                                               # 2,433,024 B a page in 10 regions (the CPU's)
    # the same region counts with small pages: the DRAM copy inside UCX's post (cma) then leaves the host's caches
    # warm, as a GPU's copy does, and the pieces show what they cost on a warm host
    "tiny": {"dtype": "fp8_e4m3", "page_size": 4, "n_layers": 1, "head_dim": 512, "index_dim": 64,
             "layer_ratios": (4,)},                            # 4,112 B, 1 region
    "tiny-float": {"page_size": 128, "head_dim": 8, "index_dim": 4},   # 19,520 B, 10 regions
}


def make_pool(layout: str, pages: int, device: str) -> KVPool:
    from .kv_transfer_sides import build_pool
    pool = build_pool("flash", 4, 256, 1, "meta")
    return KVPool(replace(pool.layout, num_pages=pages, **LAYOUTS[layout]), device=device)


def decode(conn, layout: str, pages: int, device: str) -> None:
    transfer = NixlTransfer("hp-decode", make_pool(layout, pages, device))
    conn.send(transfer.local_info().to_json())
    while not conn.poll(0):
        for _ in transfer.notifications():
            conn.send("notif")
    conn.recv()


def _spin(transfer: NixlTransfer, handle, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while transfer._agent.check_xfer_state(handle) == "PROC":
        if time.monotonic() > end:
            raise RuntimeError("a WRITE did not finish within 10 s")


def pieces(t: NixlTransfer, peer: str, src: list[int], dst: list[int], notif: bytes) -> dict[str, float]:
    """write_pages' and poll's steps as they run there (prepped mode), a clock between each."""
    c = time.perf_counter
    t0 = c()
    with t._lock:
        t1 = c()
        info = t._peers[peer]
        s = _check_pages(src, t._num_pages, t.name)
        d = _check_pages(dst, info.num_pages, peer)
        t2 = c()
        si, di = _indices(s, len(t._local), t._num_pages), _indices(d, len(info.buffers), info.num_pages)
        t3 = c()
        h = t._agent.make_prepped_xfer("WRITE", t._local_prepped, si, t._prepped[peer], di, notif)
        t4 = c()
        t._agent.transfer(h)
        t5 = c()
    t6 = c()
    _spin(t, h)
    t7 = c()
    with t._lock:
        t8 = c()
        XferState(t._agent.check_xfer_state(h))
        t9 = c()
        t._release(h)
        t10 = c()
    t11 = c()
    return {"lock_w": (t1 - t0) + (t6 - t5), "check_pages": t2 - t1, "indices": t3 - t2, "make_prepped": t4 - t3,
            "post": t5 - t4, "xfer_spin": t7 - t6, "lock_p": (t8 - t7) + (t11 - t10), "check_state": t9 - t8,
            "release": t10 - t9}


def whole(t: NixlTransfer, peer: str, src: list[int], dst: list[int], notif: bytes) -> dict[str, float]:
    c = time.perf_counter
    t0 = c()
    h = t.write_pages(peer, src, dst, notif)
    t1 = c()
    _spin(t, h)
    t2 = c()
    state = t.poll(h)
    t3 = c()
    assert state is XferState.DONE, state
    return {"write_pages": t1 - t0, "poll_done": t3 - t2}


def raw(t: NixlTransfer, info, n: int, first_dst: int, notif: bytes) -> dict[str, float]:
    """bench/kv_transfer_sides.py's raw WRITE (RawAgent.write, .poll) of region 0's pages as one descriptor."""
    (base, size), (rbase, _) = t._local[0], info.buffers[0]
    c, agent, dev, mem = time.perf_counter, t._agent, t._device_id, t._mem_type
    t0 = c()
    local = np.array([[base, n * size, dev]], dtype=np.uint64)
    remote = np.array([[rbase + first_dst * size, n * size, info.device_id]], dtype=np.uint64)
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, info.mem_type),
                              info.agent_name, notif)
    agent.transfer(h)
    t1 = c()
    _spin(t, h)
    t2 = c()
    agent.check_xfer_state(h)
    agent.release_xfer_handle(h)
    return {"raw_write": t1 - t0, "raw_poll_done": c() - t2}


def check_before(pages: list[int], num_pages: int) -> np.ndarray:
    """`_check_pages` and `_indices` (one region) before they converted with array("I"): np.asarray to int64, then
    int32."""
    p = np.asarray(pages, dtype=np.int64)
    if p.size and int(p.view(np.uint64).max()) >= num_pages:
        raise ValueError("outside")
    return np.asarray(p, dtype=np.int64).astype(np.int32)


def make_only(t: NixlTransfer, local: tuple, remote: tuple, notif: bytes) -> float:
    """make_prepped_xfer of (prepared list, indices) on each side, never posted."""
    t0 = time.perf_counter()
    h = t._agent.make_prepped_xfer("WRITE", local[0], local[1], remote[0], remote[1], notif)
    dt = time.perf_counter() - t0
    t._agent.release_xfer_handle(h)
    return dt


def run(a: argparse.Namespace) -> dict:
    pool_pages = 2 * max(a.pages) + 8
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=decode, args=(there, a.layout, pool_pages, a.device), daemon=True)
    child.start()
    try:
        pool = make_pool(a.layout, pool_pages, a.device)
        for b in pool.buffers():
            b.fill_(1)
        t = NixlTransfer("hp-prefill", pool)
        if not here.poll(120):
            raise RuntimeError("the decode child said nothing in 120 s")
        from dsv4_cluster.workers.kv.transfer import PeerInfo
        info = PeerInfo.from_json(here.recv())
        t.add_peer(info)
        out = {"layout": a.layout, "regions": len(pool.regions()), "page_bytes": pool.page_bytes,
               "load_avg_start": os.getloadavg()[0], "sizes": {}}
        notif = b'{"room": 1}'

        def wait_notif():
            if not here.poll(10):
                raise RuntimeError("no notification reached the decode child in 10 s")
            here.recv()

        for n in a.pages:
            src, dst = list(range(n)), list(range(pool_pages - n, pool_pages))   # one run each side
            runs: dict[str, list[float]] = {}
            for i in range(a.warmup + a.reps):
                got = {**pieces(t, info.agent_name, src, dst, notif)}
                wait_notif()
                got.update(whole(t, info.agent_name, src, dst, notif))
                wait_notif()
                got.update(raw(t, info, n, pool_pages - n, notif))
                wait_notif()
                if i >= a.warmup:
                    for k, v in got.items():
                        runs.setdefault(k, []).append(v)
            s, d = np.asarray(src, np.int64), np.asarray(dst, np.int64)
            si, di = _indices(s, len(t._local), t._num_pages), _indices(d, len(info.buffers), info.num_pages)
            whole_l = t._agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(
                [(base + 0 * size, n * size, t._device_id) for base, size in t._local], dtype=np.uint64), t._mem_type)
            whole_r = t._agent.prep_xfer_dlist(info.agent_name, np.array(
                [(base + (pool_pages - n) * size, n * size, info.device_id) for base, size in info.buffers],
                dtype=np.uint64), info.mem_type)
            one = np.arange(len(t._local), dtype=np.int32)
            variants = {"mk_int32": ((t._local_prepped, si), (t._prepped[info.agent_name], di)),
                        "mk_int64": ((t._local_prepped, si.astype(np.int64)),
                                     (t._prepped[info.agent_name], di.astype(np.int64))),
                        "mk_list": ((t._local_prepped, si.tolist()), (t._prepped[info.agent_name], di.tolist())),
                        "mk_whole_desc": ((whole_l, one), (whole_r, one))}
            c = time.perf_counter
            for i in range(a.warmup + a.reps):
                t0 = c()
                check_before(src, t._num_pages), check_before(dst, info.num_pages)
                t1 = c()
                _indices(_check_pages(src, t._num_pages, "a"), 1, t._num_pages)
                _indices(_check_pages(dst, info.num_pages, "b"), 1, info.num_pages)
                t2 = c()
                if i >= a.warmup:
                    runs.setdefault("check_idx_before", []).append(t1 - t0)
                    runs.setdefault("check_idx_now", []).append(t2 - t1)
                for k, (lo, re) in variants.items():
                    dt = make_only(t, lo, re, notif)
                    if i >= a.warmup:
                        runs.setdefault(k, []).append(dt)
            t._agent.release_dlist_handle(whole_l)
            t._agent.release_dlist_handle(whole_r)
            out["sizes"][n] = {k: round(statistics.median(v) * 1e6, 2) for k, v in runs.items()}
            print(f"[kv_write_host] {n} pages: {out['sizes'][n]}", file=sys.stderr, flush=True)
        out["load_avg_end"] = os.getloadavg()[0]
        return out
    finally:
        here.send("stop")
        child.join(10)
        if child.is_alive():
            child.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", default=",".join(map(str, PAGE_COUNTS)))
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--layout", choices=list(LAYOUTS), default="tiny")
    p.add_argument("--device", default="cpu", help="the pools' device (both processes), e.g. cuda:0")
    a = p.parse_args(argv)
    a.pages = [int(x) for x in a.pages.split(",") if x]
    out = run(a)
    out["device"] = a.device
    keys = list(next(iter(out["sizes"].values())))
    print(f"device {a.device}, layout {out['layout']} ({out['regions']} regions, {out['page_bytes']} B a page), load average "
          f"{out['load_avg_start']:.2f} -> {out['load_avg_end']:.2f}; median us of {a.reps} reps")
    print("| piece | " + " | ".join(str(n) for n in out["sizes"]) + " |")
    print("| --- |" + " --- |" * len(out["sizes"]))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(v[k]) for v in out["sizes"].values()) + " |")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
