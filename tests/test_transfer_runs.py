"""`NixlTransfer.write_pages` coalesces consecutive pages into one descriptor per buffer and run: the runs
are those where both sides' pages are consecutive, and a WRITE of mixed runs lands every page where it belongs
(real NIXL agents in one process, every buffer of a two-layer pool compared page by page)."""

from __future__ import annotations

import time

import torch

from dsv4_cluster.workers.kv_pool import KVPool, PoolLayout
from dsv4_cluster.workers.transfer import NixlTransfer, _descs, page_runs


def test_runs_break_where_either_side_stops_being_consecutive():
    assert page_runs([0, 1, 2, 5, 6, 9], [3, 4, 7, 8, 9, 1]) == [(0, 3, 2), (2, 7, 1), (5, 8, 2), (9, 1, 1)]
    assert page_runs(list(range(8)), list(range(10, 18))) == [(0, 10, 8)]
    assert page_runs([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]       # descending is not a run
    assert page_runs([], []) == []


def test_descriptors_cover_each_run_once_per_buffer_buffer_major():
    rows = _descs([(1000, 10), (5000, 4)], [(2, 3), (7, 1)], device_id=1)
    assert rows.tolist() == [[1020, 30, 1], [1070, 10, 1], [5008, 12, 1], [5028, 4, 1]]


def test_a_write_of_mixed_runs_lands_every_page_in_place():
    layout = PoolLayout(page_size=4, num_pages=12, n_layers=2, head_dim=8, index_dim=4, ratio=4, dtype="float32")
    src, dst = KVPool(layout), KVPool(layout)
    for b in src.buffers():
        b.copy_(torch.rand(b.shape) + 1)
    prefill, decode = NixlTransfer("p-runs", src), NixlTransfer("d-runs", dst)
    prefill.add_peer(decode.local_info())
    src_pages, dst_pages = [0, 1, 2, 5, 6, 9], [3, 4, 7, 8, 9, 1, 11]   # decode reserved one page more
    handle = prefill.write_pages("d-runs", src_pages, dst_pages, b"room")
    deadline = time.monotonic() + 10
    while (state := prefill.poll(handle)) == "PROC" and time.monotonic() < deadline:
        decode.notifications()
    assert state == "DONE"
    n = layout.num_pages
    for s_buf, d_buf in zip(src.buffers(), dst.buffers()):
        s_pages, d_pages = s_buf.view(n, -1), d_buf.view(n, -1)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(d_pages[d], s_pages[s])
        untouched = [p for p in range(n) if p not in dst_pages[: len(src_pages)]]
        assert d_pages[untouched].eq(0).all()
