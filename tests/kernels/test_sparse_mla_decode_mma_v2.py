"""Sparse MLA decode: the mma.sync Gluon kernel (`gluon_mma_v2.py`, the sm_120 row at 64 heads) against the float64
reference on the GPU. mma.sync runs on sm_90 as on sm_120, so an H200 runs the kernel as compiled for itself; the
forced-sm_120 tests (`test_sm120_path.py`) run it through SGLang's sm_120 entry. Without a GPU: the host side's
refusals, by name."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.sparse_mla_decode import SparseDecodeInputError
from dsv4_cluster.kernels.sparse_mla_decode.config import LaunchConfig, mma_v2_unavailable
from dsv4_cluster.kernels.sparse_mla_decode.launch import sparse_mla_decode_fp8_triton, sparse_mla_decode_triton
from tests.kernels.sparse_decode_cases import (HAS_CUDA, V4, assert_close, assert_graph_replays, fp8_reference64,
                                               make_case, moved, odd_e4m3_cache, reference64, v4_call)


def mma_v2_ready():
    return HAS_CUDA and mma_v2_unavailable(torch.device("cuda"), 64, torch.bfloat16) is None


mma_v2_gpu = pytest.mark.skipif(not mma_v2_ready(), reason="needs a CUDA GPU and the Triton release Gluon was built for")


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("warps, words, lazy", [(8, False, False), (16, False, False), (8, True, False),
                                                (16, True, False), (8, False, True), (8, True, True), (16, True, True)])
@pytest.mark.parametrize("b, splits", [(1, 0), (1, 1), (8, 0), (8, 3), (64, 2), (130, 0), (3, 60)])
def test_gpu_mma_v2_matches_reference(fp8, warps, words, lazy, b, splits):
    """Ragged lengths, -1 entries, one query with no valid row, sinks on even B; one split, several, and more
    splits than a query has blocks (splits with no rows). 16 warps: the warps across S's 16 columns hold copies.
    words: fp8 dequantised four bytes at a time (bf16 rows ignore it). lazy: the reference max moves only when a
    block's max passes it by more than 2**8."""
    _matches_reference(64, fp8, warps, words, lazy, b, splits, seed=300)


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("warps, words, lazy", [(4, False, False), (8, False, False), (4, True, True), (8, True, True)])
@pytest.mark.parametrize("b, splits", [(1, 0), (8, 3), (130, 0), (3, 60)])
def test_gpu_mma_v2_16_heads_matches_reference(fp8, warps, words, lazy, b, splits):
    """16 heads (TP4's real head count): one warp row, the warps across S's columns holding copies."""
    _matches_reference(16, fp8, warps, words, lazy, b, splits, seed=700)


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("pairs", [1, 2, 5])
@pytest.mark.parametrize("b, splits", [(1, 0), (8, 3), (64, 2), (130, 0), (3, 60)])
def test_gpu_mma_v2_paired_blocks_match_reference(monkeypatch, lazy, pairs, b, splits):
    """The kernel taking two blocks at a time (gluon_mma_v2_pair.py; the sm_120 64-head row from 10 blocks a split,
    here from 1, 2 or 5, so that odd counts, single blocks and splits with no rows all run): fp8 in words, 8 warps,
    as the plan launches it. The launch is the paired kernel's exactly when a split's share of the 40 configured
    blocks (128 window + 512 extra rows) reaches `pairs`, the one-block kernel's otherwise."""
    from dsv4_cluster.kernels.sparse_mla_decode import gluon_mma_v2, gluon_mma_v2_pair, launch

    launched, real = [], launch.fast_launch
    def spy(kernel, grid, *args, **kwargs):
        launched.append((kernel, grid))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "fast_launch", spy)
    _matches_reference(64, True, 8, True, lazy, b, splits, seed=900 + pairs, pairs=pairs)
    kernel, (_, used_splits) = launched[0]
    paired = -(-40 // used_splits) >= pairs
    assert kernel is (gluon_mma_v2_pair._sparse_decode_mma_v2_pair_kernel if paired else
                      gluon_mma_v2._sparse_decode_mma_v2_kernel), (used_splits, pairs)


def _matches_reference(heads, fp8, warps, words, lazy, b, splits, seed, pairs=0):
    c = make_case(b, **dict(V4, h=heads), device="cuda", seed=seed + b + splits, sink=b % 2 == 0)
    cfg = LaunchConfig(backend="gluon_mma_v2", num_splits=splits, num_warps=warps, fp8_words=words,
                       lazy_rescale=lazy, pair_min_blocks=pairs)
    run, (ref_out, ref_lse) = v4_call(c, fp8, cfg)
    out, lse = run()
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [False, True])
def test_gpu_mma_v2_window_only_full_lengths_and_growing_maxima(lazy):
    """No extra cache, every row valid, and scores whose row maxima keep growing block after block (each block's
    rows scaled up): O and the sums rescaled at every block (lazy: whenever a maximum grew by more than 2**8)."""
    c = make_case(5, 64, 256, 0, 4096, 0, device="cuda", seed=9, ragged=False, sink=True)
    rows = torch.arange(256, dtype=torch.int32, device="cuda") * 16  # every query: rows 0, 16, ... 4080 in order
    c["window_idx"] = rows.expand(5, 256).contiguous()
    c["kv"] = (c["kv"].float() * torch.linspace(0.1, 6.0, 4096, device="cuda")[:, None]).to(c["kv"].dtype)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(backend="gluon_mma_v2", lazy_rescale=lazy))
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("words", [False, True])
def test_gpu_mma_v2_fp8_dequantises_subnormals_and_large_scales_exactly(words):
    c = make_case(6, **V4, device="cuda", seed=31, sink=True)
    c["q"] = c["q"] * 0.02
    cache, extra = odd_e4m3_cache(c.pop("kv"), 1), odd_e4m3_cache(c.pop("extra_kv"), 2)
    out, lse = sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra,
                                            config=LaunchConfig(backend="gluon_mma_v2", fp8_words=words))
    cpu = moved(c, "cpu")
    ref_out, ref_lse = fp8_reference64(cpu, cache, extra)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@mma_v2_gpu
@pytest.mark.gpu
def test_gpu_mma_v2_replays_in_a_cuda_graph():
    c = make_case(16, **V4, device="cuda", seed=5, sink=True)
    assert_graph_replays(c, LaunchConfig(backend="gluon_mma_v2"))


@pytest.mark.parametrize("heads, dtype, why", [(32, torch.bfloat16, "takes 64 or 16 heads"),
                                               (64, torch.float16, "takes bf16 queries")])
def test_mma_v2_refuses_what_it_cannot_run_by_name(heads, dtype, why):
    assert mma_v2_unavailable(torch.device("cpu"), 64, torch.bfloat16) == "it runs on CUDA tensors only"
    assert why in mma_v2_unavailable(torch.device("cuda"), heads, dtype)
    assert mma_v2_unavailable(torch.device("cuda"), 16, torch.float16) == "it takes bf16 queries; got torch.float16"


@mma_v2_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config, what", [(LaunchConfig(backend="gluon_mma_v2", block_n=32), "block_n 16"),
                                          (LaunchConfig(backend="gluon_mma_v2", num_warps=4), "num_warps 8 or 16 at 64 heads")])
def test_gpu_mma_v2_refuses_a_config_it_cannot_launch(config, what):
    c = make_case(2, **V4, device="cuda", seed=1)
    with pytest.raises(SparseDecodeInputError, match=what):
        sparse_mla_decode_triton(**c, config=config)


def test_sm120_64_heads_runs_mma_v2_on_fp8_from_b8_and_the_triton_row_elsewhere(plans_on):
    """The dispatch of the sm_120 row at 64 heads, without a GPU: fp8 caches from B = 8 on the mma.sync kernel; below
    B = 8, on bf16 rows, or when asked for "triton", the row's Triton fallback config (16-head programs)."""
    from dsv4_cluster.kernels import dispatch
    from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import PageGeometry

    plan_launch = plans_on("sm_120")
    geos = (PageGeometry.packed(256), PageGeometry.packed(64))
    row = dispatch.decode_impl("sm_120", 64)

    def plan(b, fp8=True, backend="auto"):
        p = plan_launch(torch.device("cuda"), b, 64, torch.bfloat16, fp8, LaunchConfig(backend=backend),
                        128, 512, (True, True, True, True), geos, 188)
        return p.backend, p.config.block_n, p.config.head_group, p.config.num_warps, p.grid[1:]

    fallback = ("triton", row.fallback.block_n, row.fallback.head_group, row.fallback.num_warps)
    assert plan(8)[:4] == plan(128)[:4] == ("gluon_mma_v2", 16, 0, 8)
    assert plan(8)[4] == (plan(8)[4][0],)  # grid (B, splits): one program per query and split
    for b in (1, row.min_batch - 1):
        assert plan(b)[:4] == fallback and plan(b)[4][1] == 64 // row.fallback.head_group
    assert plan(64, fp8=False)[:4] == fallback
    assert plan(64, backend="triton")[:4] == fallback
    assert plan(1, backend="gluon_mma_v2")[0] == "gluon_mma_v2"  # asked for by name: kept at any B


def test_sm120_64_heads_take_the_ratio4_blocks_two_at_a_time_where_splits_hold_enough(plans_on):
    """The plan's pairs (`plan._pairs`), without a GPU: on the ratio-4 cache (64 entries a page) where a split holds
    the row's 10 blocks or more (c4: 128 + 512 rows, 40 blocks); not on the ratio-128 cache (2 entries a page), not
    at small B (few blocks a split), not when the config turns them off or asks for 16 warps, not without an extra
    cache."""
    from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import PageGeometry

    plan_launch = plans_on("sm_120")

    def pairs(b, extra_page=64, k=512, extra=True, **cfg):
        p = plan_launch(torch.device("cuda"), b, 64, torch.bfloat16, True, LaunchConfig(**cfg), 128, k,
                        (extra, True, extra, True), (PageGeometry.packed(256), PageGeometry.packed(extra_page)), 132)
        return p.backend == "gluon_mma_v2" and p.pairs, -(-(8 + -(-k // 16)) // p.splits)

    assert pairs(128) == (True, 40) and pairs(32)[0] and pairs(64)[0]
    assert pairs(8) == (False, pairs(8)[1]) and pairs(8)[1] < 10
    assert not pairs(128, extra_page=2)[0] and not pairs(128, extra_page=2, k=8192)[0]
    assert not pairs(128, pair_min_blocks=0)[0] and not pairs(128, num_warps=16)[0]
    assert not pairs(128, k=0, extra=False, pair_min_blocks=1)[0]   # a window-only call: no extra cache to pair on


def test_the_word_dequantisation_arithmetic_is_exact_for_every_e4m3_byte():
    """The steps of gluon_mma_v2.E4M3_WORD, with the constants read from its PTX, replayed in torch: every e4m3 byte
    (NaNs aside) times scales 2**-22 ... 2**10 gives exactly the bf16 of e4m3 x scale (the byte path's result)."""
    import re

    from dsv4_cluster.kernels.sparse_mla_decode.gluon_mma_v2 import E4M3_WORD

    asm = E4M3_WORD.value
    shift = int(re.search(r"shr\.b32 sa, a, (\d+);", asm).group(1))
    field, sign = (int(re.search(rf"and\.b32 {r}, {r}, (0x[0-9a-f]+);", asm).group(1), 16) & 0xFFFF for r in ("sa", "a"))
    up = int(re.search(r"mov\.b32 up, (0x[0-9a-f]+);", asm).group(1), 16) & 0xFFFF
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # e4m3 NaN: 0x7f, 0xff
    values = codes.view(torch.float8_e4m3fn).float()
    half = codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF  # cvt, exact
    moved = (((half >> shift) & field) | (half & sign)).to(torch.int16).view(torch.bfloat16)  # value x 2**-112
    up_bf16 = torch.tensor([up], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for e in range(127 - 22, 127 + 11):
        scale = torch.tensor([e << 7], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # 2**(e - 127)
        got = moved * up_bf16 * scale
        assert torch.equal(got.view(torch.int16), (values * 2.0 ** (e - 127)).to(torch.bfloat16).view(torch.int16)), e


def test_the_16_head_kernel_splits_for_two_ctas_an_sm(plans_on):
    """The 16-head mma.sync kernel runs two CTAs an SM, so its split count spreads B x splits over twice the SMs: on
    a c4 call (window 128 + 512 indices, 132 SMs) 8 / 4 / 2 / 1 splits at B = 32 / 64 / 128 / 256, the H200 probe's
    bests at 64 ... 256 (splits.MMA_V2_16_HEAD_CTAS_PER_SM); at 64 heads (8 warps, one CTA an SM) the one-CTA count."""
    from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import PageGeometry
    from dsv4_cluster.kernels.sparse_mla_decode.splits import choose_splits

    plan_launch = plans_on("sm_90")
    geos = (PageGeometry.packed(256), PageGeometry.packed(64))

    def splits(b, h):
        cfg = LaunchConfig(backend="gluon_mma_v2", num_warps=4 if h == 16 else 8, fp8_words=True, lazy_rescale=True)
        p = plan_launch(torch.device("cuda"), b, h, torch.bfloat16, True, cfg, 128, 512, (True, True, True, True),
                        geos, 132)
        assert p.backend == "gluon_mma_v2" and p.grid == (b, p.splits)
        return p.splits

    assert [splits(b, 16) for b in (32, 64, 128, 256)] == [8, 4, 2, 1]
    assert [splits(b, 64) for b in (32, 64, 128, 256)] == [choose_splits(b, 40, 132) for b in (32, 64, 128, 256)]
    assert [splits(b, 64) for b in (64, 128)] == [2, 1]
