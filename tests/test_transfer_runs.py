"""`NixlTransfer.write_pages` coalesces consecutive pages into one descriptor per buffer and run: the runs
are those where both sides' pages are consecutive, and a WRITE of mixed runs lands every page where it belongs
(real NIXL agents in one process, every buffer of a two-layer pool compared page by page)."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4_cluster.workers.kv_pool import KVPool, PoolLayout
from dsv4_cluster.workers.transfer import DESCRIPTOR_MODES, NixlTransfer, _descs, _indices, page_runs


def test_runs_break_where_either_side_stops_being_consecutive():
    assert page_runs([0, 1, 2, 5, 6, 9], [3, 4, 7, 8, 9, 1]) == [(0, 3, 2), (2, 7, 1), (5, 8, 2), (9, 1, 1)]
    assert page_runs(list(range(8)), list(range(10, 18))) == [(0, 10, 8)]
    assert page_runs([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]       # descending is not a run
    assert page_runs([], []) == []


def test_descriptors_cover_each_run_once_per_region_region_major():
    rows = _descs([(1000, 10), (5000, 4)], [(2, 3), (7, 1)], device_id=1)
    assert rows.tolist() == [[1020, 30, 1], [1070, 10, 1], [5008, 12, 1], [5028, 4, 1]]


FLOAT = PoolLayout(page_size=4, num_pages=12, n_layers=2, head_dim=8, index_dim=4, ratio=4, dtype="float32")
# fp8: SGLang's 584-B rows, one ratio-4 layer (main, comp, keys) and one ratio-128 layer (main, comp)
FP8 = PoolLayout(page_size=128, num_pages=12, n_layers=2, head_dim=512, index_dim=64, ratio=4, dtype="fp8_e4m3",
                 layer_ratios=(4, 128))


def test_an_fp8_pool_is_one_region_a_float_pool_one_per_buffer():
    fp8, flt = KVPool(FP8), KVPool(FLOAT)
    assert len(fp8.buffers()) == 5 and len(fp8.regions()) == 1
    region, per_page = fp8.regions()[0]
    assert per_page == fp8.page_bytes == FP8.page_bytes == region.stride(0)
    for b in fp8.buffers():      # every buffer is a view into the region, pages a region page apart
        assert b.stride(0) == per_page and region.data_ptr() <= b.data_ptr() < region.data_ptr() + per_page
    assert [t.data_ptr() for t, _ in flt.regions()] == [b.data_ptr() for b in flt.buffers()]
    assert flt.page_bytes == FLOAT.page_bytes


def test_prepped_indices_are_region_major_so_consecutive_pages_are_consecutive_descriptors():
    assert _indices([3, 4, 9], regions=2, num_pages=12).tolist() == [3, 4, 9, 15, 16, 21]


@pytest.mark.parametrize("descriptors", DESCRIPTOR_MODES)
@pytest.mark.parametrize("layout", [FLOAT, FP8], ids=["float32", "fp8"])
def test_a_write_of_mixed_runs_lands_every_page_in_place(layout, descriptors):
    src, dst = KVPool(layout), KVPool(layout)
    for b in src.buffers():
        b.copy_(torch.rand(b.shape) + 1 if b.dtype.is_floating_point else torch.randint(1, 256, b.shape,
                                                                                        dtype=torch.uint8))
    name = f"{layout.dtype}-{descriptors}"
    prefill = NixlTransfer(f"p-{name}", src, descriptors=descriptors)
    decode = NixlTransfer(f"d-{name}", dst, descriptors=descriptors)
    prefill.add_peer(decode.local_info())
    src_pages, dst_pages = [0, 1, 2, 5, 6, 9], [3, 4, 7, 8, 9, 1, 11]   # decode reserved one page more
    handle = prefill.write_pages(f"d-{name}", src_pages, dst_pages, b"room")
    deadline = time.monotonic() + 10
    while (state := prefill.poll(handle)) == "PROC" and time.monotonic() < deadline:
        decode.notifications()
    assert state == "DONE"
    n = layout.num_pages
    for s_buf, d_buf in zip(src.buffers(), dst.buffers()):
        s_pages, d_pages = s_buf.reshape(n, -1), d_buf.reshape(n, -1)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(d_pages[d], s_pages[s])
        untouched = [p for p in range(n) if p not in dst_pages[: len(src_pages)]]
        assert d_pages[untouched].eq(0).all()
