"""`NixlTransfer.write_pages` coalesces consecutive pages into one descriptor per buffer and run: the runs
are those where both sides' pages are consecutive, and a WRITE of mixed runs lands every page where it belongs
(real NIXL agents in one process, every buffer of a two-layer pool compared page by page)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout
from dsv4_cluster.workers.kv.transfer import (DESCRIPTOR_MODES, NixlTransfer, TransferError, _descs, _indices,
                                           page_runs)
from tests.helpers import wait_for


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
    for regions in (1, 2):       # int32: what NIXL's binding converts fastest (bench/results/kv_write_host_cpu.md)
        assert _indices([3, 4], regions, 12).dtype == np.int32


def _write_and_compare(src_layout: PoolLayout, dst_layout: PoolLayout, descriptors: str, name: str,
                       src_pages: list[int], dst_pages: list[int]) -> None:
    """WRITE `src_pages` of a random prefill pool into `dst_pages` of a zeroed decode pool over real NIXL agents;
    every destination page must hold its source page's bytes, every other decode page stay zero."""
    src, dst = KVPool(src_layout), KVPool(dst_layout)
    for b in src.buffers():
        b.copy_(torch.rand(b.shape) + 1 if b.dtype.is_floating_point else torch.randint(1, 256, b.shape,
                                                                                        dtype=torch.uint8))
    prefill = NixlTransfer(f"p-{name}", src, descriptors=descriptors)
    decode = NixlTransfer(f"d-{name}", dst, descriptors=descriptors)
    prefill.add_peer(decode.local_info())
    handle = prefill.write_pages(f"d-{name}", src_pages, dst_pages, b"room")
    def written() -> str | None:   # both sides make progress only while polled
        decode.notifications()
        return None if (state := prefill.poll(handle)) == "PROC" else state
    assert wait_for(written, 10, "the WRITE", interval_s=0) == "DONE"
    for s_buf, d_buf in zip(src.buffers(), dst.buffers()):
        s_pages, d_pages = s_buf.reshape(src_layout.num_pages, -1), d_buf.reshape(dst_layout.num_pages, -1)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(d_pages[d], s_pages[s]), f"decode page {d} does not hold prefill page {s}"
        untouched = [p for p in range(dst_layout.num_pages) if p not in dst_pages[: len(src_pages)]]
        assert d_pages[untouched].eq(0).all()


@pytest.mark.parametrize("descriptors", DESCRIPTOR_MODES)
@pytest.mark.parametrize("layout", [FLOAT, FP8], ids=["float32", "fp8"])
def test_a_write_of_mixed_runs_lands_every_page_in_place(layout, descriptors):
    _write_and_compare(layout, layout, descriptors, f"{layout.dtype}-{descriptors}",
                       [0, 1, 2, 5, 6, 9], [3, 4, 7, 8, 9, 1, 11])   # decode reserved one page more


@pytest.mark.parametrize("descriptors", DESCRIPTOR_MODES)
@pytest.mark.parametrize("layout", [FLOAT, FP8], ids=["float32", "fp8"])
@pytest.mark.parametrize("decode_pages", [36, 8], ids=["decode-3x", "decode-smaller"])
def test_a_decode_pool_of_another_size_gets_every_page_in_place(layout, descriptors, decode_pages):
    """Pools differ in capacity only (decode usually holds more: every running request's KV). The descriptors of
    the decode side come from its own page count: pages above the prefill's pool size land where they belong."""
    dst_layout = replace(layout, num_pages=decode_pages)
    dst_pages = [2, 20, 21, 30, 31, 35] if decode_pages > layout.num_pages else [7, 0, 1, 4, 5, 3]
    _write_and_compare(layout, dst_layout, descriptors, f"{layout.dtype}-{descriptors}-{decode_pages}",
                       [0, 1, 2, 5, 6, 11], dst_pages)


@pytest.mark.parametrize("descriptors", DESCRIPTOR_MODES)
def test_a_destination_page_outside_the_decode_pool_is_refused_before_nixl_sees_it(descriptors):
    src, dst = KVPool(FLOAT), KVPool(replace(FLOAT, num_pages=20))
    prefill = NixlTransfer(f"p-oob-{descriptors}", src, descriptors=descriptors)
    decode = NixlTransfer(f"d-oob-{descriptors}", dst, descriptors=descriptors)
    prefill.add_peer(decode.local_info())
    with pytest.raises(TransferError, match="page 20 .* 20 pages"):
        prefill.write_pages(decode.name, [0, 1], [19, 20], b"room")
    with pytest.raises(TransferError, match="page 12 .* 12 pages"):
        prefill.write_pages(decode.name, [11, 12], [0, 1], b"room")
    for src_pages, dst_pages, bad in (([0, 1], [-1, 0], "-1 .* 20"), ([-3, 1], [0, 1], "-3 .* 12"),
                                      ([0, 1], [0, 2**32], f"{2**32} .* 20"), ([0.5, 1], [0, 1], "0.5 .* 12")):
        with pytest.raises(TransferError, match=f"page {bad} pages"):
            prefill.write_pages(decode.name, src_pages, dst_pages, b"room")


@pytest.mark.parametrize("enabled", [True, False], ids=["telemetry", "no-telemetry"])
def test_poll_hands_nixls_telemetry_of_a_finished_write_to_its_hook(monkeypatch, enabled):
    """With NIXL_TELEMETRY_ENABLE=y (read when an agent starts) `poll`'s hook gets NIXL's telemetry of the WRITE
    before its handle goes: one merged descriptor for a run of pages in the fp8 pool's one region, every byte;
    without it, None. Only a finished WRITE calls the hook, once."""
    if enabled:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    else:
        monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    src, dst = KVPool(FP8), KVPool(FP8)
    name = f"tele-{enabled}"
    prefill, decode = NixlTransfer(f"p-{name}", src), NixlTransfer(f"d-{name}", dst)
    prefill.add_peer(decode.local_info())
    handle, seen = prefill.write_pages(decode.name, [2, 3, 4], [7, 8, 9], b"room"), []
    def written() -> str | None:
        decode.notifications()
        return None if (state := prefill.poll(handle, seen.append)) == "PROC" else state
    assert wait_for(written, 10, "the WRITE", interval_s=0) == "DONE"
    assert len(seen) == 1
    if enabled:
        assert seen[0]["descCount"] == 1 and seen[0]["totalBytes"] == 3 * src.page_bytes
        assert 0 <= seen[0]["postDuration"] <= seen[0]["xferDuration"]
    else:
        assert seen == [None]
