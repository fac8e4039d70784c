"""Raw stages for the mma.sync Gluon kernel (`gluon_mma_v2.py`, `LaunchConfig(raw_stages=N)`): V4 fp8 records
gathered by cp.async into shared memory N blocks ahead, instead of into registers one block ahead.

Why: at 16 heads the kernel's compute per block is small, and with one block of records in flight in registers
each iteration waits on a gather (H100, c4, B = 128, two CTAs an SM: ~2.9 us a 16-row block, against ~0.9 us of
issued instructions). cp.async holds no registers while in flight, so N - 2 blocks are on their way while a block
is computed. A raw stage is a block's records as they lie in the cache: bytes 0-511 of each 576-byte record
(tiles 0-6 of e4m3 and the first half of the RoPE tile, int32 words), bytes 448-575 (the RoPE tile as int64
words of four bf16) and the 8 scale bytes; 10,368 B a stage at block 16. Rows past the length or of invalid
index are zero-filled by the copy: zero bytes with a zero scale dequantise to 0, and the kernel masks their
scores. `_raw_read` returns what `gluon_mma_v2._load_words` returns for the same block, so `_dequant` is
unchanged.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def block_indices(j, hi, nbw, wlen, elen, widx_row, eidx_row, offs, BN: gl.constexpr):
    """Cache rows of live block j at positions `offs` (its layout), -1 where invalid, past the length or j >= hi."""
    is_w = j < nbw
    pos = gl.where(is_w, j, j - nbw) * BN + offs
    n_valid = gl.where(j < hi, gl.where(is_w, wlen, elen), 0)
    return gl.load(gl.where(is_w, widx_row, eidx_row) + pos, mask=pos < n_valid, other=-1)


@gluon.jit
def raw_alloc(RAW: gl.constexpr, BN: gl.constexpr):
    """RAW raw stages: (no-RoPE words [RAW, BN, 8, 16] int32, RoPE words [RAW, BN, 16] int64, scales
    [RAW, BN, 8] uint8), unswizzled row-major (a warp copies and reads whole 512-byte rows)."""
    nope = gl.allocate_shared_memory(gl.int32, [RAW, BN, 8, 16], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    rope = gl.allocate_shared_memory(gl.int64, [RAW, BN, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    sc = gl.allocate_shared_memory(gl.uint8, [RAW, BN, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return nope, rope, sc


@gluon.jit
def raw_issue(j, hi, nbw, wlen, elen, widx_row, eidx_row, kv_ptr, ekv_ptr, nope_s, rope_s, sc_s,
              L3: gl.constexpr, BN: gl.constexpr, W_SHIFT: gl.constexpr, W_PAGE: gl.constexpr,
              E_SHIFT: gl.constexpr, E_PAGE: gl.constexpr):
    """cp.async live block j's records into one raw stage (16-byte copies of the words, 4-byte of the scales),
    then commit them as one group."""
    NW: gl.constexpr = gl.num_warps()
    LRO: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [NW, 1], [1, 0])   # [BN, 16] int64: 16 B a thread
    LSC: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [NW, 1], [1, 0])  # [BN, 8] bytes: 4 B a thread
    is_w = j < nbw
    base = gl.where(is_w, kv_ptr, ekv_ptr)
    shift = gl.where(is_w, W_SHIFT, E_SHIFT)
    mask_slot = (1 << shift) - 1

    idx = block_indices(j, hi, nbw, wlen, elen, widx_row, eidx_row,
                gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), BN)
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    row32 = (idx >> shift).to(gl.int64) * gl.where(is_w, W_PAGE // 4, E_PAGE // 4) + (idx & mask_slot) * 144
    ptr = base.to(gl.pointer_type(gl.int32), bitcast=True) + row32[:, None, None] + (t[None, :, None] * 16
                                                                                     + w[None, None, :])
    async_copy.async_copy_global_to_shared(nope_s, ptr, mask=(idx >= 0)[:, None, None])

    idx = block_indices(j, hi, nbw, wlen, elen, widx_row, eidx_row, gl.arange(0, BN, layout=gl.SliceLayout(1, LRO)), BN)
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, LRO))
    row64 = (idx >> shift).to(gl.int64) * gl.where(is_w, W_PAGE // 8, E_PAGE // 8) + (idx & mask_slot) * 72 + 56
    ptr = base.to(gl.pointer_type(gl.int64), bitcast=True) + row64[:, None] + w[None, :]
    async_copy.async_copy_global_to_shared(rope_s, ptr, mask=(idx >= 0)[:, None])

    idx = block_indices(j, hi, nbw, wlen, elen, widx_row, eidx_row, gl.arange(0, BN, layout=gl.SliceLayout(1, LSC)), BN)
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, LSC))
    row8 = ((idx >> shift).to(gl.int64) * gl.where(is_w, W_PAGE, E_PAGE)
            + gl.where(is_w, 576 << W_SHIFT, 576 << E_SHIFT) + (idx & mask_slot) * 8)
    async_copy.async_copy_global_to_shared(sc_s, base + row8[:, None] + t[None, :], mask=(idx >= 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def raw_read(nope_s, rope_s, sc_s, L3: gl.constexpr):
    """One landed raw stage as `_load_words` returns a block: no-RoPE words [BN, 8, 16] (layout L3), RoPE words
    [BN, 1, 16] (broadcast over the tiles), scales [BN, 8]."""
    rope = rope_s.load(gl.SliceLayout(1, L3))
    return nope_s.load(L3), gl.expand_dims(rope, 1), sc_s.load(gl.SliceLayout(2, L3))
