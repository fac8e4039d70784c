"""Sparse MLA decode: the 16-head wgmma Gluon kernel (`gluon_h16.py`, sm_90) against the float64 reference on the GPU;
without an sm_90 GPU, its refusals by name."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.sparse_mla_decode import SparseDecodeInputError, launch
from dsv4_cluster.kernels.sparse_mla_decode.config import LaunchConfig, gluon_api_unavailable
from dsv4_cluster.kernels.sparse_mla_decode.launch import sparse_mla_decode_fp8_triton, sparse_mla_decode_triton
from tests.kernels.sparse_decode_cases import (HAS_CUDA, V4, assert_close, assert_graph_replays, fp8_reference64,
                                               make_case, moved, odd_e4m3_cache, v4_call)

SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9 and gluon_api_unavailable() is None
h16_gpu = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and the Triton release Gluon was built for")


@h16_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("loader_warps", [4, 8])
@pytest.mark.parametrize("b, splits", [(1, 0), (8, 3), (130, 0), (3, 60)])
def test_gpu_h16_matches_reference(fp8, loader_warps, b, splits):
    """Ragged lengths, -1 entries, a query with no valid row, sinks on even B; splits with no rows."""
    c = make_case(b, **dict(V4, h=16), device="cuda", seed=1100 + b + splits, sink=b % 2 == 0)
    cfg = LaunchConfig(backend="gluon_h16", num_splits=splits, loader_warps=loader_warps)
    run, (ref_out, ref_lse) = v4_call(c, fp8, cfg)
    out, lse = run()
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@h16_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("b, k, splits", [(32, 512, 0), (64, 8192, 0), (64, 8192, 16), (5, 512, 7)])
def test_gpu_h16_merges_its_splits_in_the_kernel_and_leaves_the_counters_at_zero(monkeypatch, fp8, b, k, splits):
    """The last split of a query to finish merges it, with no merge kernel: on full lists, and on a ratio-128 list
    of a configured 1M context with a few live blocks (most splits without rows), with a query of one live block and
    one of none; equal to the reference like the merge kernel's path, three launches in a row, counters back at 0."""
    merges, merge_kernel = [], launch._combine
    monkeypatch.setattr(launch, "_combine", lambda *a: (merges.append(a), merge_kernel(*a)))
    c = make_case(b, **dict(V4, h=16, k=k), device="cuda", seed=1200 + b + k + splits, sink=b % 2 == 0)
    if k > 512:  # a configured 1M: at most 300 of the 8,192 entries live
        g = torch.Generator().manual_seed(b + splits)
        c["extra_lens"] = torch.randint(0, 300, (b,), generator=g, dtype=torch.int32).cuda()
    c["window_lens"][1], c["extra_lens"][1] = 0, 0   # no row at all
    c["window_lens"][2], c["extra_lens"][2] = 40, 0  # one block
    for fused in (None, False):
        run, (ref_out, ref_lse) = v4_call(c, fp8, LaunchConfig(backend="gluon_h16", num_splits=splits,
                                                               fused_merge=fused))
        for _ in range(3):
            out, lse = run()
        assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)
        assert len(merges) == (0 if fused is None else 3)  # 3 merge-kernel launches: the call did split
        merges.clear()
    torch.cuda.synchronize()
    assert not launch._SPLIT_COUNTERS[torch.cuda.current_device()].any()


@h16_gpu
@pytest.mark.gpu
def test_gpu_h16_fp8_dequantises_subnormals_and_large_scales_exactly():
    c = make_case(40, **dict(V4, h=16), device="cuda", seed=31, sink=True)
    c["q"] = c["q"] * 0.02
    cache, extra = odd_e4m3_cache(c.pop("kv"), 1), odd_e4m3_cache(c.pop("extra_kv"), 2)
    out, lse = sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra,
                                            config=LaunchConfig(backend="gluon_h16"))
    ref_out, ref_lse = fp8_reference64(moved(c, "cpu"), cache, extra)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@h16_gpu
@pytest.mark.gpu
def test_gpu_h16_replays_in_a_cuda_graph():
    c = make_case(64, **dict(V4, h=16), device="cuda", seed=5, sink=True)
    assert_graph_replays(c, LaunchConfig(backend="gluon_h16"))


@pytest.mark.parametrize("heads", [64, 32])
def test_h16_refuses_other_head_counts_by_name(heads):
    c = make_case(2, **dict(V4, h=heads), device="cuda" if SM90 else "cpu", seed=3)
    with pytest.raises(SparseDecodeInputError, match="16-head Gluon kernel cannot run this call"):
        sparse_mla_decode_triton(**c, config=LaunchConfig(backend="gluon_h16"))


def test_the_sm90_16_head_row_runs_the_wgmma_kernel_from_b32_and_the_mma_v2_row_below(plans_on):
    """The dispatch of the sm_90 row at 16 heads, without a GPU: from the row's min_batch (32) the 16-head wgmma
    kernel on fp8 and bf16 rows; below it the mma.sync row (fp8; bf16: its Triton fallback); a ratio-128 list whose
    index table does not fit the wgmma kernel's shared memory (2M configured) on the mma.sync row; asked by name, kept."""
    from dsv4_cluster.kernels import dispatch
    from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import PageGeometry

    plan_launch = plans_on("sm_90")
    geos = (PageGeometry.packed(256), PageGeometry.packed(64))
    row = dispatch.decode_impl("sm_90", 16)

    def plan(b, fp8=True, backend="auto", k=512):
        p = plan_launch(torch.device("cuda"), b, 16, torch.bfloat16, fp8, LaunchConfig(backend=backend), 128, k,
                        (True, True, True, True), geos, 132)
        return p.backend

    assert row.min_batch == 32
    assert [plan(b) for b in (1, 8, 31, 32, 64, 128, 256)] == ["gluon_mma_v2"] * 3 + ["gluon_h16"] * 4
    assert plan(64, fp8=False) == "gluon_h16" and plan(8, fp8=False) == "triton"
    assert plan(64, k=8192) == "gluon_h16"        # ratio 128 at a configured 1M: 130 blocks of indices fit
    assert plan(64, k=16384) == "gluon_mma_v2"    # at 2M they do not; the mma.sync kernel streams them
    assert plan(8, backend="gluon_h16") == "gluon_h16"
    assert plan(64, backend="gluon_mma_v2") == "gluon_mma_v2"
