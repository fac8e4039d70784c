"""Sparse MLA decode: reference semantics, the V4 fp8 layout, and the Triton kernel against the reference.

On CPU the Triton kernel runs under Triton's interpreter (small shapes, same code path); on a GPU
the same checks run at DeepSeek-V4 shapes, plus CUDA-graph capture and replay. The Gluon kernel's
tests are in test_sparse_mla_decode_gluon.py; the cases and tolerances both use, in sparse_decode_cases.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_cluster.kernels.sparse_mla_decode import (
    SparseDecodeInputError,
    dequantize_kv_v4,
    quantize_kv_v4,
    sparse_mla_decode_fp8_ref,
    sparse_mla_decode_ref,
)
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, launch
from dsv4_cluster.kernels.sparse_mla_decode import splits as split_rules
from dsv4_cluster.kernels.sparse_mla_decode.launch import (
    LaunchConfig,
    sparse_mla_decode_fp8_triton,
    sparse_mla_decode_triton,
)
from tests.kernels.sparse_decode_cases import HAS_CUDA, V4, assert_close, make_case, moved, reference64

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture(scope="module")
def triton_kernels():
    """The device the Triton kernels run on: CUDA, or CPU through Triton's interpreter.

    The interpreter must be on before triton is imported (tests/conftest.py sets
    TRITON_INTERPRET=1 without CUDA); a CPU run without it fails here rather than skip the kernel.
    """
    if HAS_CUDA:
        return "cuda"
    if type(launch._kernels._sparse_decode_kernel).__name__ != "InterpretedFunction":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1 at import: run pytest with TRITON_INTERPRET=1")
    return "cpu"


# ---- reference semantics ----

def brute_force(q, rows_per_query, sink, scale):
    """Per query and head with Python loops: the definition, in float64."""
    b, h, d = q.shape
    out = torch.zeros(b, h, d, dtype=torch.float64)
    lse = torch.full((b, h), -math.inf, dtype=torch.float64)
    for i in range(b):
        rows = rows_per_query[i]
        for j in range(h):
            if not rows:
                continue
            s = torch.stack([q[i, j].double() @ r.double() * scale for r in rows])
            lse[i, j] = torch.logsumexp(s, 0)
            o = sum(torch.exp(s[t] - lse[i, j]) * rows[t].double() for t in range(len(rows)))
            if sink is not None:
                o = o * math.exp(lse[i, j]) / (math.exp(lse[i, j]) + math.exp(sink[j]))
            out[i, j] = o
    return out, lse


@pytest.mark.parametrize("with_sink", [False, True])
def test_reference_matches_definition_at_engine_shapes(with_sink):
    c = make_case(3, 8, 6, 5, 20, 12, dtype=torch.float32, d=64, seed=1, sink=with_sink)
    out, lse = sparse_mla_decode_ref(**c)
    rows = []
    for i in range(3):
        picked = [c["kv"][t] for p, t in enumerate(c["window_idx"][i].tolist()) if t >= 0 and p < c["window_lens"][i]]
        picked += [c["extra_kv"][t] for p, t in enumerate(c["extra_idx"][i].tolist()) if t >= 0 and p < c["extra_lens"][i]]
        rows.append(picked)
    ref_out, ref_lse = brute_force(c["q"], rows, None if c["sink"] is None else c["sink"].tolist(), 64**-0.5)
    assert out.dtype == torch.float32 and out.shape == (3, 8, 64) and lse.shape == (3, 8)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.zeros(2, 8)), "q must be"),
        (dict(kv=torch.zeros(10, 32)), "kv must be"),
        (dict(window_idx=torch.zeros(2, 4, dtype=torch.int64)), "int32"),
        (dict(window_idx=torch.full((2, 4), 10, dtype=torch.int32)), "outside"),
        (dict(sink=torch.zeros(3)), "sink must be"),
        (dict(extra_kv=torch.zeros(5, 64)), "go together"),
        (dict(window_lens=torch.zeros(3, dtype=torch.int32)), "window_lens"),
    ],
)
def test_reference_rejects_bad_input(change, match):
    c = make_case(2, 8, 4, 0, 10, 0, dtype=torch.float32, d=64, seed=3)
    c.update(change)
    with pytest.raises(SparseDecodeInputError, match=match):
        sparse_mla_decode_ref(**c)


# ---- V4 fp8 layout ----

def test_fp8_layout_sizes_and_round_trip():
    assert fp8_layout.BYTES_PER_TOKEN == 584 and fp8_layout.PAGE_STRIDE == 37440
    kv = (torch.randn(100, 512) * torch.logspace(-3, 2, 100)[:, None]).to(torch.bfloat16)
    cache = quantize_kv_v4(kv)
    assert cache.shape == (2, 37440) and cache.dtype == torch.uint8
    back = dequantize_kv_v4(cache)
    assert back.shape == (128, 512) and back.dtype == torch.bfloat16
    assert torch.equal(back[:100, 448:], kv[:, 448:]), "RoPE dims are stored as bf16, exactly"
    nope, ref = back[:100, :448].float().view(100, 7, 64), kv[:, :448].float().view(100, 7, 64)
    tile_amax = ref.abs().amax(-1, keepdim=True)
    assert ((nope - ref).abs() <= tile_amax / 16 + 1e-6).all(), "e4m3 keeps 3 mantissa bits per tile scale"
    exps = cache[:, fp8_layout.SCALES_OFFSET : fp8_layout.SCALES_OFFSET + 64 * 8].reshape(128, 8)
    assert (exps[:100, 7] == 0).all() and (exps[:100, :7] > 0).all()
    view = fp8_layout.flashmla_view(cache)
    assert view.shape == (2, 64, 1, 584) and view.stride(0) == 37440 and view.dtype == torch.float8_e4m3fn


def test_fp8_layout_rejects_wrong_cache():
    with pytest.raises(SparseDecodeInputError, match="37440"):
        dequantize_kv_v4(torch.zeros(2, 584 * 64, dtype=torch.uint8))
    with pytest.raises(SparseDecodeInputError, match=r"\[N, 512\]"):
        quantize_kv_v4(torch.zeros(4, 576))


# ---- Triton kernel against the reference (interpreter on CPU, real GPU otherwise) ----

SMALL = dict(b=3, h=16, w=24, k=40, n=300, m=200)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 3, 9])  # 9: the one-shot merge, with empty splits
@pytest.mark.parametrize("with_sink", [False, True])
def test_triton_matches_reference(triton_kernels, dtype, splits, with_sink):
    c = make_case(**SMALL, dtype=dtype, device=triton_kernels, seed=10 + splits, sink=with_sink)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(block_n=16, num_splits=splits))
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_head_groups_match_reference(triton_kernels, splits):
    """Programs of 16 heads each over a 32-head call (the sm_120 rows' head_group): every group its own heads,
    q / out / lse / sink and the split partials offset by the group."""
    c = make_case(3, 32, 40, 24, 100, 60, device=triton_kernels, seed=40 + splits)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(block_n=16, num_splits=splits, head_group=16))
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("splits, prefetch", [(1, True), (2, False)])
def test_triton_window_only_without_lengths(triton_kernels, splits, prefetch):
    c = make_case(2, 16, 40, 0, 100, 0, device=triton_kernels, seed=20, ragged=False, sink=False)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(block_n=16, num_splits=splits, prefetch=prefetch))
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("splits, prefetch", [(1, True), (4, True), (2, False)])
def test_triton_fp8_matches_reference(triton_kernels, splits, prefetch):
    c = make_case(**SMALL, device="cpu", seed=30 + splits)
    cache, extra = quantize_kv_v4(c.pop("kv")), quantize_kv_v4(c.pop("extra_kv"))
    ref_out, ref_lse = sparse_mla_decode_fp8_ref(**{**c, "q": c["q"].double()}, kv_cache=cache, extra_cache=extra)
    dev = {k: (v.to(triton_kernels) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    out, lse = sparse_mla_decode_fp8_triton(**dev, kv_cache=cache.to(triton_kernels), extra_cache=extra.to(triton_kernels),
                                            config=LaunchConfig(block_n=16, num_splits=splits, prefetch=prefetch))
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


def test_split_choice_is_the_measured_best_on_an_h200():
    """choose_splits for the V4 decode (10 blocks of 64 rows, 132 SMs) gives the splits the H200 sweeps
    measured fastest per batch size (bench/results/sparse_decode.md), with the merge kernel (the Triton
    kernel; with 32-row blocks, twice as many) and with the Gluon kernel's fused merge."""
    assert [split_rules.choose_splits(b, 10, 132) for b in (1, 8, 32, 64, 128)] == [10, 5, 4, 2, 1]
    assert [split_rules.choose_splits(b, 20, 132) for b in (1, 8, 32, 64, 128)] == [20, 10, 4, 2, 1]
    assert split_rules.choose_splits(4096, 10, 132) == 1  # many queries: no split, no merge
    assert split_rules.choose_splits(1, 1, 132) == 1
    fused = [split_rules.choose_splits(b, 10, 132, fused=True) for b in (1, 8, 32, 33, 64, 128)]
    assert fused == [16, 10, 4, 4, 2, 1]
    # from B = 34, 4 splits per query no longer fit on the SMs at once: the merge kernel's choice
    assert split_rules.choose_splits(34, 10, 132, fused=True) == split_rules.choose_splits(34, 10, 132) == 2
    assert all(b * split_rules.choose_splits(b, 10, 132, fused=True) <= 132 for b in range(1, 34))
    # Gluon on bf16 rows: the merge weighs more, so B = 64 runs unsplit (fp8 keeps 2 splits)
    bf16, fp8 = LaunchConfig(backend="gluon"), True
    assert [split_rules.gluon_splits(bf16, b, 10, 132, not fp8) for b in (1, 8, 32, 48, 64, 128)] == [16, 10, 4, 2, 1, 1]
    assert [split_rules.gluon_splits(bf16, b, 10, 132, fp8) for b in (1, 8, 32, 48, 64, 128)] == [16, 10, 4, 2, 2, 1]
    assert split_rules.gluon_splits(LaunchConfig(num_splits=3), 64, 10, 132, fp8) == 3  # asked for: as asked


def test_16_head_split_floor_splits_a_query_where_choose_splits_would_split_its_live_blocks():
    """The 16-head wgmma kernel's split count comes from the configured width; a query with n live blocks runs on
    n // h16_min_blocks of those splits (`gluon_kernel._split_share`). So a query splits where `choose_splits` would
    split its live blocks, whatever width the list is configured to (SGLang's ratio-128 list: context / 128)."""
    def floor(b):  # a ratio-128 list configured for 1M: 2 + 128 blocks
        return split_rules.h16_min_blocks(b, 130, 132)

    assert [floor(b) for b in (1, 8, 32, 33)] == [1, 1, 1, 1]  # up to B x 4 splits on the SMs: every block splits
    assert floor(64) == 4  # choose_splits first splits 8 blocks two ways at B = 64
    for b in range(34, 128):
        first = next((n for n in range(2, 131) if split_rules.choose_splits(b, n, 132) > 1), None)
        if first is None:  # the launch itself is not split: the floor is never read
            assert split_rules.choose_splits(b, 130, 132) == 1
            continue
        assert (first - 2) // floor(b) < 2 <= first // floor(b), b  # odd first: one block early


@pytest.mark.parametrize("h, splits, merge", [(16, 2, "_combine_kernel"), (16, 3, "_combine_kernel"),
                                              (32, 3, "_combine_stream_kernel"), (32, 9, "_combine_kernel")])
def test_merge_kernel_by_heads(triton_kernels, monkeypatch, h, splits, merge):
    """At 16 heads the one-shot merge takes every split count (the streaming merge has too few programs there); at
    32 and 64 the streaming one runs below ONESHOT_MERGE_FROM splits. Both equal the reference."""
    seen, real = [], launch.fast_launch
    monkeypatch.setattr(launch, "fast_launch", lambda kernel, *a, **kw: (seen.append(kernel), real(kernel, *a, **kw)))
    c = make_case(3, h, 24, 40, 300, 200, device=triton_kernels, seed=70 + h + splits, sink=True)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(block_n=16, num_splits=splits))
    assert seen[-1] is getattr(launch._kernels, merge)
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


def test_triton_rejects_unsupported_shapes():
    c = make_case(2, 8, 4, 0, 10, 0, d=64, seed=4)
    with pytest.raises(SparseDecodeInputError, match="D=512"):
        sparse_mla_decode_triton(**c)
    c = make_case(2, 16, 4, 0, 10, 0, seed=4)
    c["kv"] = c["kv"].float()
    with pytest.raises(SparseDecodeInputError, match="q's dtype"):
        sparse_mla_decode_triton(**c)


# ---- GPU: DeepSeek-V4 shapes, CUDA graphs ----

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("with_sink", [False, True])
def test_gpu_v4_shapes_bf16_and_fp8(b, with_sink):
    c = make_case(b, **V4, device="cuda", seed=b, sink=with_sink)
    out, lse = launch.sparse_mla_decode_triton(**c)
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)
    cache, extra = quantize_kv_v4(c.pop("kv")), quantize_kv_v4(c.pop("extra_kv"))
    out8, lse8 = launch.sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra)
    ref8 = sparse_mla_decode_fp8_ref(**moved(c, "cpu"),
                                     kv_cache=cache.cpu(), extra_cache=extra.cpu())
    assert_close(out8.cpu(), lse8.cpu(), ref8[0].double(), ref8[1], torch.bfloat16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_replay_with_new_indices(fp8):
    b = 8
    c = make_case(b, **V4, device="cuda", seed=40)
    caches = dict(kv_cache=quantize_kv_v4(c["kv"]), extra_cache=quantize_kv_v4(c["extra_kv"])) if fp8 else {}

    def call():
        if fp8:
            rest = {k: v for k, v in c.items() if k not in ("kv", "extra_kv")}
            return launch.sparse_mla_decode_fp8_triton(**rest, **caches)
        return launch.sparse_mla_decode_triton(**c)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    fresh = make_case(b, **V4, device="cuda", seed=41)
    for key in ("q", "window_idx", "extra_idx", "window_lens", "extra_lens"):
        c[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    e_out, e_lse = call()
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)
