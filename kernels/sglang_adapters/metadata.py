"""SGLang 0.5.23's two DeepSeek-V4 decode-metadata builders, same signatures, same bytes out, spread over the row.

    _init_compressed_attn_metadata_triton(...)  (sglang.kernels.ops.attention.dsv4.metadata_kernel)
    build_page_table_positions_triton(*, ...)   (sglang.kernels.ops.attention.dsv4.attn_metadata_kernels)

Why: SGLang launches each with one program per request that walks the whole configured width in a loop: the
ratio-128 index list (max_pages x 2 slots, -1 past the live ones) and the page table (max_seq_len / page_size
entries gathered from req_to_token). At a configured 1M context that is 128 and 16 dependent iterations a
program, and the step's device time grew by 25-55 us at B = 1-128 from 8K to 1M in these two kernels alone
(torch profiler over SGLang's 43-layer graph step, H100: docs/sglang.md). Here each request's row is cut into
chunks, one program each, so the walk is as long as one chunk whatever the configured context. The index list
loads page-table entries only below the request's ratio-128 length (SGLang loads them all, then writes -1 over
the rest): the same values. The page table is gathered in full, so every output is byte-equal to SGLang's
(tests/kernels/test_sglang_metadata.py runs both, SGLang's through the Triton interpreter on the CPU).
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from ..fast_launch import launch
from ..sglang_plugin.call_sites import META_MODULE, PAGES_MODULE

INDEX_CHUNK = 1024  # ratio-128 slots a program writes (a 1M context: 8,192 a request, 8 programs)
PAGE_CHUNK = 256  # page-table entries a program gathers (SGLang's BLOCK_P; 1M at 256-token pages: 16 programs)
# Where SGLang's program walks one chunk (its loop runs once: a context up to 8K for the index list, 64K for the
# page table) there is nothing to spread, and ours measured 0.91-1.01x SGLang's (H100, graph, cold L2;
# bench/results/sglang_metadata.md): those calls go to SGLang's own builder.
_STOCK: dict[str, object] = {}


def sglang_builder(module: str, attr: str):
    """SGLang's own builder `attr` of `module`: the module's function, or, once the plugin has installed ours
    there, the one it replaced (kept on the installed wrapper as `dsv4_stock`)."""
    fn = _STOCK.get(attr)
    if fn is None:
        fn = getattr(importlib.import_module(module), attr)
        fn = _STOCK[attr] = getattr(fn, "dsv4_stock", fn)
    if getattr(fn, "dsv4_adapter", None) is not None:
        raise RuntimeError(f"{module}.{attr} holds the plugin's wrapper without SGLang's builder behind it")
    return fn


@triton.jit(do_not_specialize=["num_write_tokens"])
def _compressed_metadata_kernel(
    seq_lens_ptr, positions_ptr, raw_out_loc_ptr, page_table_ptr,
    c4_out_loc_ptr, c4_positions_ptr, c4_raw_ptr, c4_clamp1_ptr,
    c128_out_loc_ptr, c128_positions_ptr, c128_raw_ptr, c128_clamp1_ptr, c128_page_indices_ptr,
    num_write_tokens, max_pages, width,
    C128_PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + row)
    if tl.program_id(1) == 0:  # the per-request values, exactly as SGLang's kernel computes them
        position = tl.load(positions_ptr + row)
        is_write = row < num_write_tokens
        raw_out_loc = tl.load(raw_out_loc_ptr + row, mask=is_write, other=0)
        tl.store(c4_out_loc_ptr + row, tl.where((seq_len % 4) == 0, raw_out_loc // 4, 0), mask=is_write)
        tl.store(c4_positions_ptr + row, position & (~3))
        tl.store(c4_raw_ptr + row, seq_len // 4)
        tl.store(c4_clamp1_ptr + row, tl.maximum(seq_len // 4, 1))
        tl.store(c128_out_loc_ptr + row, tl.where((seq_len % 128) == 0, raw_out_loc // 128, 0), mask=is_write)
        tl.store(c128_positions_ptr + row, position & (~127))
        tl.store(c128_raw_ptr + row, seq_len // 128)
        tl.store(c128_clamp1_ptr + row, tl.maximum(seq_len // 128, 1))
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # this program's chunk of the ratio-128 list
    in_row = offsets < width
    live = offsets < seq_len // 128
    page = offsets // C128_PAGE
    pages = tl.load(page_table_ptr + row * max_pages + page, mask=in_row & live & (page < max_pages), other=0)
    slots = tl.where(live, pages * C128_PAGE + offsets % C128_PAGE, -1)
    tl.store(c128_page_indices_ptr + row * width + offsets, slots, mask=in_row)


def _init_compressed_attn_metadata_triton(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    compute_page_indices: bool = True,
):
    """SGLang's `_init_compressed_attn_metadata_triton`: (c4_out_loc, c4_positions, c4_seq_lens_raw,
    c4_seq_lens_clamp1, c128_out_loc, c128_positions, c128_seq_lens_raw, c128_seq_lens_clamp1,
    c128_page_indices or None), with its assertions; SGLang's own where its walk is one chunk."""
    # SGLang's loop: BLOCK_SIZE = next_power_of_2(max(page_size // 128, 64)) slots a pass over the list's width
    one_chunk = not compute_page_indices or page_table is None or page_size < 128 or (
        (page_size // 128) * page_table.shape[1] <= triton.next_power_of_2(max(page_size // 128, 64)))
    if one_chunk:  # also every call SGLang's own assertions refuse (no page table, a page under 128 tokens)
        return sglang_builder(META_MODULE, "_init_compressed_attn_metadata_triton")(
            seq_lens, positions, raw_out_loc, page_table, page_size, compute_page_indices)
    bs, num_write = seq_lens.shape[0], raw_out_loc.shape[0]
    assert num_write <= bs, f"raw_out_loc has {num_write} rows, expected at most {bs} metadata rows"
    assert page_size % 128 == 0, "page_size must be a multiple of 128 when compute_page_indices=True"
    device = seq_lens.device
    out = [torch.empty(num_write, dtype=torch.int64, device=device)]
    out += [torch.empty(bs, dtype=torch.int32, device=device) for _ in range(3)]
    out += [torch.empty(num_write, dtype=torch.int64, device=device)]
    out += [torch.empty(bs, dtype=torch.int32, device=device) for _ in range(3)]
    max_pages, c128_page = page_table.shape[1], page_size // 128
    width = c128_page * max_pages
    indices = torch.empty(bs, width, dtype=torch.int32, device=device)
    block = min(INDEX_CHUNK, triton.next_power_of_2(max(width, 64)))
    if bs:
        launch(_compressed_metadata_kernel, (bs, triton.cdiv(width, block)),
               (seq_lens, positions, raw_out_loc, page_table, *out, indices, num_write, max_pages, width),
               {"C128_PAGE": c128_page, "BLOCK": block})
    return (*out, indices)


@triton.jit
def _page_table_positions_kernel(
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr, seq_lens_out_ptr, positions_out_ptr, page_table_ptr,
    topk_out_ptr, rt_stride, num_pages, page_size, swa_window, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.program_id(1) == 0:
        seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
        tl.store(seq_lens_out_ptr + row, seq_len)
        tl.store(positions_out_ptr + row, seq_len - 1)
        tl.store(topk_out_ptr + row, tl.minimum(seq_len, swa_window))
    base = req_to_token_ptr + tl.load(req_pool_ptr + row).to(tl.int64) * rt_stride
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = p < num_pages
    tok = tl.load(base + p.to(tl.int64) * page_size, mask=mask, other=0).to(tl.int32)
    tl.store(page_table_ptr + row.to(tl.int64) * num_pages + p, tok // page_size, mask=mask)


def build_page_table_positions_triton(
    *,
    req_to_token: torch.Tensor,
    req_pool_indices_repeated: torch.Tensor,
    seq_lens_casual: torch.Tensor,
    max_seq_len: int,
    page_size: int,
    swa_window: int,
):
    """SGLang's `build_page_table_positions_triton`: its PageTablePositionsResult (seq_lens_casual as int32,
    positions_casual = seq_lens - 1, page_table [num_q, ceil(max_seq_len / page_size)], swa_topk_lengths);
    SGLang's own where its walk is one chunk."""
    if -(-max_seq_len // page_size) <= PAGE_CHUNK:
        return sglang_builder(PAGES_MODULE, "build_page_table_positions_triton")(
            req_to_token=req_to_token, req_pool_indices_repeated=req_pool_indices_repeated,
            seq_lens_casual=seq_lens_casual, max_seq_len=max_seq_len, page_size=page_size, swa_window=swa_window)
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import PageTablePositionsResult

    num_q = seq_lens_casual.shape[0]
    num_pages = (max_seq_len + page_size - 1) // page_size
    device = seq_lens_casual.device
    seq_lens_out = torch.empty(num_q, dtype=torch.int32, device=device)
    positions_out = torch.empty(num_q, dtype=torch.int32, device=device)
    page_table = torch.empty((num_q, num_pages), dtype=torch.int32, device=device)
    topk_out = torch.empty(num_q, dtype=torch.int32, device=device)
    if num_q:
        args = (req_to_token, req_pool_indices_repeated, seq_lens_casual, seq_lens_out, positions_out, page_table,
                topk_out, req_to_token.stride(0), num_pages, page_size, swa_window)
        launch(_page_table_positions_kernel, (num_q, max(triton.cdiv(num_pages, PAGE_CHUNK), 1)), args,
               {"BLOCK_P": PAGE_CHUNK})
    return PageTablePositionsResult(seq_lens_casual=seq_lens_out, positions_casual=positions_out,
                                    page_table=page_table, swa_topk_lengths=topk_out)
