"""Our DeepSeek-V4 decode-metadata builders against SGLang 0.5.23's own, byte for byte.

Both run the same inputs: on the CPU through the Triton interpreter (SGLang's kernels too), on a GPU compiled.
Shapes as SGLang's decode hands them: 256-token pages, a page table as wide as the configured context, requests
of mixed lengths (some on a ratio-128 boundary, one of a single token), fewer cache-write rows than metadata rows
(CP padding), and a req_to_token pool whose unused tail holds stale values that the page table must copy as is.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bench.sglang_stand_ins import install_import_stand_ins
from dsv4_cluster.kernels.sglang_adapters import metadata as ours
from tests.sglang_support import require_sglang

PAGE = 256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lengths(batch: int, context: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, context + 1, (batch,), generator=g, dtype=torch.int32)
    edges = torch.tensor([1, 128, 256, context], dtype=torch.int32)[:batch]
    lens[: edges.numel()] = edges
    return lens


# (batch, configured context): the 8K and 1M shapes of the SGLang-backend rig (8K: SGLang's own builders, whose
# walk is one chunk there), the narrowest widths ours takes (16K: a 128-slot index list; 64K + 1 page: a page
# table of 257 entries), and widths that leave the last chunk partial (a page table 4,097 pages wide).
CASES = [(4, 8192), (3, 1 << 20), (5, 4097 * PAGE), (1, 300), (2, 16384), (3, 65536 + PAGE)]


@pytest.fixture(scope="module", autouse=True)
def sglang_kernels():
    """SGLang's two builder modules, imported when this module's first test runs, not at collection (every test
    process collects every module, and SGLang's import is seconds of a core); every test here needs SGLang."""
    require_sglang()            # skipped without the pinned SGLang, never in CI (CI=true fails instead)
    install_import_stand_ins()  # the GPU image lacks some of SGLang's import-time packages (none is called here)
    return (importlib.import_module("sglang.kernels.ops.attention.dsv4.metadata_kernel"),
            importlib.import_module("sglang.kernels.ops.attention.dsv4.attn_metadata_kernels"))


@pytest.mark.parametrize("batch,context", CASES)
@pytest.mark.parametrize("compute", [True, False])
def test_compressed_metadata_equals_sglangs(batch, context, compute, sglang_kernels):
    lens = _lengths(batch, context, seed=batch + context)
    pages = -(-context // PAGE)
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 1 << 20, (batch, pages), generator=g, dtype=torch.int32).to(DEVICE)
    positions = (lens - 1).to(DEVICE)
    raw_out_loc = torch.randint(0, 1 << 30, (max(batch - 1, 1),), generator=g, dtype=torch.int64).to(DEVICE)
    args = (lens.to(DEVICE), positions, raw_out_loc, table if compute else None, PAGE, compute)
    want = sglang_kernels[0]._init_compressed_attn_metadata_triton(*args)
    got = ours._init_compressed_attn_metadata_triton(*args)
    assert len(got) == len(want) == 9
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, f"output {i}: SGLang returns None, ours a tensor"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        assert torch.equal(a, b), f"output {i} differs at {(a != b).nonzero()[:4].tolist()}"
    if compute:  # not vacuous: live slots were mapped through the page table, the rest are -1
        idx = got[8]
        assert (idx[0, : int(lens[0]) // 128] >= 0).all() and (idx[:, -1] == -1).any()


@pytest.mark.parametrize("batch,context", CASES)
def test_page_table_positions_equal_sglangs(batch, context, sglang_kernels):
    lens = _lengths(batch, context, seed=7 * batch + context)
    g = torch.Generator().manual_seed(5)
    pool_rows = batch + 2
    # req_to_token as SGLang keeps it: one row per request slot, `context` token locations wide; every entry set
    # (live or stale), so a gather that skipped the tail would differ.
    req_to_token = torch.randint(0, 1 << 24, (pool_rows, context), generator=g, dtype=torch.int32).to(DEVICE)
    pool_idx = torch.randperm(pool_rows, generator=g)[:batch].to(DEVICE)
    kw = dict(req_to_token=req_to_token, req_pool_indices_repeated=pool_idx, seq_lens_casual=lens.to(DEVICE),
              max_seq_len=context, page_size=PAGE, swa_window=128)
    want = sglang_kernels[1].build_page_table_positions_triton(**kw)
    got = ours.build_page_table_positions_triton(**kw)
    assert type(got) is type(want)
    for name in ("seq_lens_casual", "positions_casual", "page_table", "swa_topk_lengths"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:4].tolist()}"
    assert got.page_table.shape[1] == -(-context // PAGE)


def test_compressed_metadata_keeps_sglangs_assertions():
    lens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="expected at most 2 metadata rows"):
        ours._init_compressed_attn_metadata_triton(lens, lens - 1, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(AssertionError, match="multiple of 128"):
        ours._init_compressed_attn_metadata_triton(lens, lens - 1, torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                                   torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), 64)


def test_ours_run_where_sglangs_walk_is_longer_than_one_chunk(monkeypatch):
    """8K (a 64-slot index list, 32 pages): SGLang's builders; 16K / 64K + 1 page and wider: ours."""
    called = []
    real = ours.sglang_builder

    def recording(module, attr):
        called.append(attr)
        return real(module, attr)

    monkeypatch.setattr(ours, "sglang_builder", recording)
    for context, stock in ((8192, True), (16384, False), (1 << 20, False)):
        called.clear()
        lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
        table = torch.zeros(1, context // PAGE, dtype=torch.int32, device=DEVICE)
        ours._init_compressed_attn_metadata_triton(lens, lens - 1, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                                   table, PAGE)
        assert called == (["_init_compressed_attn_metadata_triton"] if stock else []), context
    for context, stock in ((65536, True), (65536 + PAGE, False)):
        called.clear()
        ours.build_page_table_positions_triton(
            req_to_token=torch.zeros(2, context, dtype=torch.int32, device=DEVICE),
            req_pool_indices_repeated=torch.tensor([1], device=DEVICE),
            seq_lens_casual=torch.tensor([9], dtype=torch.int32, device=DEVICE), max_seq_len=context,
            page_size=PAGE, swa_window=128)
        assert called == (["build_page_table_positions_triton"] if stock else []), context
