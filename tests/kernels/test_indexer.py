"""Indexer: Triton kernel against the torch reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.indexer.fused_topk import indexer_topk_triton
from dsv4_cluster.kernels.indexer.fp8_keys import dequantize_keys, quantize_keys
from dsv4_cluster.kernels.indexer.reference import indexer_fp8_ref, indexer_ref
from dsv4_cluster.kernels.indexer.shapes import IndexerInputError
from dsv4_cluster.kernels.indexer.triton_indexer import indexer_fp8_triton, indexer_triton
from dsv4_cluster.kernels.topk.radix_select import workspace_size
from dsv4_cluster.kernels.topk.reference import topk_ref

# Relative L2 error allowed against the float32 reference on the same (already rounded) inputs.
# float32: IEEE dot products, only summation order differs. bf16 / fp16 inputs: products are exact
# in the fp32 accumulator, so only accumulation order over Di and Hi differs, but a relu'd sum of
# cancelling terms magnifies it. fp8: keys are widened exactly, the same as bf16 plus the scale.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3, "fp8": 2e-3}
POISON = 12345.0
GARBAGE_PAGE = 1 << 30

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The small-shape kernel tests run compiled on a GPU when there is one, else in the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(batch, heads, dim, per_page, max_pages, lens, dtype=torch.float32, device="cpu", seed=0):
    """Random inputs; physical pages shuffled; page-table slots past each live prefix hold garbage ids."""
    g = torch.Generator().manual_seed(seed)
    live_pages = [(n + per_page - 1) // per_page for n in lens]
    pages = sum(live_pages) + 3
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    table = torch.full((batch, max_pages), GARBAGE_PAGE, dtype=torch.int32)
    used = 0
    for b, lp in enumerate(live_pages):
        table[b, :lp] = perm[used : used + lp]
        used += lp
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    w = torch.randn(batch, heads, generator=g)
    keys = torch.randn(pages, per_page, dim, generator=g).to(dtype)
    return [t.to(device) for t in (q, w, keys, table, torch.tensor(lens, dtype=torch.int32))]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_against_ref(got: torch.Tensor, ref: torch.Tensor, lens, tol: float) -> None:
    for b, n in enumerate(lens):
        assert rel_err(got[b, :n].cpu(), ref[b, :n].cpu()) <= tol, f"row {b} (len {n}) off"
        assert bool((got[b, n:] == POISON).all()), f"row {b}: kernel wrote past lens[b] = {n}"


# Engine shapes (Hi=4, Di=32, E=4) and awkward ones (odd heads/dims/page sizes, empty and full rows).
CPU_CASES = [
    (3, 4, 32, 4, 9, [0, 17, 36]),
    (2, 5, 24, 3, 7, [21, 1]),
    (4, 16, 16, 8, 3, [24, 5, 0, 9]),
]


@pytest.mark.parametrize("batch,heads,dim,per_page,max_pages,lens", CPU_CASES)
def test_triton_matches_reference(batch, heads, dim, per_page, max_pages, lens):
    q, w, keys, table, n = make_case(batch, heads, dim, per_page, max_pages, lens, device=DEVICE)
    ref = indexer_ref(q, w, keys, table, n)
    assert torch.isinf(ref[0, lens[0]:]).all() and ref.shape == (batch, max_pages * per_page)
    out = torch.full_like(ref, POISON)
    got = indexer_triton(q, w, keys, table, n, out=out, block_t=16, split=2)
    assert got.data_ptr() == out.data_ptr()
    check_against_ref(got, ref, lens, TOLERANCE[torch.float32])


def test_fp8_triton_matches_fp8_reference():
    q, w, keys, table, n = make_case(3, 4, 32, 4, 9, [0, 17, 36], seed=1, device=DEVICE)
    k8 = quantize_keys(keys)
    assert k8.shape == (keys.shape[0], 4 * (32 + 4)) and k8.dtype == torch.uint8
    ref = indexer_fp8_ref(q, w, k8, table, n)
    out = torch.full_like(ref, POISON)
    check_against_ref(indexer_fp8_triton(q, w, k8, table, n, out=out, block_t=16, split=3), ref, [0, 17, 36], 1e-5)
    # Quantisation itself stays near the float keys (e4m3: 3 mantissa bits, ~6% worst case per element).
    assert rel_err(dequantize_keys(k8, 32).cpu(), keys.cpu()) < 0.05


def test_reference_formula_by_hand():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # 1 request, 2 heads, 2 dims
    w = torch.tensor([[2.0, -1.0]])
    keys = torch.tensor([[[1.0, 1.0], [-1.0, 3.0]], [[5.0, -2.0], [0.0, 0.0]]])  # 2 pages of 2
    table = torch.tensor([[1, 0]], dtype=torch.int32)  # logical page 0 -> physical 1
    scores = indexer_ref(q, w, keys, table, torch.tensor([3], dtype=torch.int32))
    # t=0: k=(5,-2): 2*5 - 0 = 10; t=1: k=(0,0): 0; t=2: k=(1,1): 2*1 - 1*1 = 1; t=3: past lens.
    assert scores.tolist() == [[10.0, 0.0, 1.0, float("-inf")]]


def test_bad_inputs_name_the_problem():
    q, w, keys, table, n = make_case(2, 4, 32, 4, 5, [7, 20])
    with pytest.raises(IndexerInputError, match="weights"):
        indexer_ref(q, w[:, :3], keys, table, n)
    with pytest.raises(IndexerInputError, match="Di = 32"):
        indexer_ref(q, w, keys[..., :16], table, n)
    with pytest.raises(IndexerInputError, match="lens must be int32"):
        indexer_ref(q, w, keys, table, n.float())
    with pytest.raises(IndexerInputError, match=r"lens must lie in \[0, max_pages\*E\] = \[0, 20\]"):
        indexer_triton(q, w, keys, table, torch.tensor([7, 21], dtype=torch.int32))
    with pytest.raises(IndexerInputError, match="physical page ids"):
        bad_table = table.clone()
        bad_table[1, 0] = -3
        indexer_triton(q, w, keys, bad_table, n)
    with pytest.raises(IndexerInputError, match="k_cache_fp8 must be uint8"):
        indexer_fp8_ref(q, w, keys, table, n)
    with pytest.raises(IndexerInputError, match="dtype"):
        indexer_triton(q, w, keys.double(), table, n)


def check_fused(idx, scores, q, w, keys, table, n, lens, k, fp8, tol):
    """Fused scores against the reference; fused indices equal, as sets, the reference top-k of the
    fused scores (the scores themselves differ from the reference by rounding)."""
    ref = (indexer_fp8_ref if fp8 else indexer_ref)(q, w, keys, table, n)
    check_against_ref(scores, ref, lens, tol)
    want = topk_ref(scores, n, k)
    for b, length in enumerate(lens):
        got = idx[b].tolist()
        assert got.count(-1) == k - min(k, length), f"row {b}: wrong padding"
        assert set(got) - {-1} == set(want[b].tolist()) - {-1}, f"row {b} (len {length}): different set"


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_indexer_topk_matches_references(fp8):
    lens = [0, 5, 17, 36, 33]
    q, w, keys, table, n = make_case(5, 4, 32, 4, 9, lens, device=DEVICE, seed=4)
    keys = quantize_keys(keys) if fp8 else keys
    scores = torch.full((5, 36), POISON, device=DEVICE)
    split = 1 if DEVICE == "cpu" else 3
    idx, got = indexer_topk_triton(q, w, keys, table, n, 8, fp8=fp8, scores=scores, split=split, block_t=16, block=16)
    assert got.data_ptr() == scores.data_ptr()
    check_fused(idx, got, q, w, keys, table, n, lens, 8, fp8, 1e-5)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_fused_production_shape_ragged_and_graph_replay(fp8):
    lens = [1, 63, 511, 512, 513, 4096, 0, 16384 - 7]
    max_pages = 300  # every page mapped, so that the graph can replay at any length up to the table's
    q, w, keys, table, n = make_case(len(lens), 64, 128, 64, max_pages, [max_pages * 64] * 8, torch.bfloat16, "cuda", 5)
    n.copy_(torch.tensor(lens, dtype=torch.int32))
    keys = quantize_keys(keys) if fp8 else keys
    scores = torch.full((len(lens), max_pages * 64), POISON, device="cuda")
    idx, _ = indexer_topk_triton(q, w, keys, table, n, 512, fp8=fp8, scores=scores)
    check_fused(idx, scores, q, w, keys, table, n, lens, 512, fp8, TOLERANCE["fp8" if fp8 else torch.bfloat16])
    out = torch.empty_like(idx)
    ws = torch.zeros(workspace_size(len(lens)), dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_topk_triton(q, w, keys, table, n, 512, fp8=fp8, scores=scores, out=out, workspace=ws)
    for replay_lens in ([0, 1, 2, 3, 4, 5, 6, 7], [max_pages * 64] * 8, [600, 512, 4000, 9000, 64, 65, 1000, 1]):
        scores.fill_(POISON)
        n.copy_(torch.tensor(replay_lens, dtype=torch.int32))
        graph.replay()
        check_fused(out, scores, q, w, keys, table, n, replay_lens, 512, fp8,
                    TOLERANCE["fp8" if fp8 else torch.bfloat16])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, "fp8"])
def test_gpu_production_shape_ragged(dtype):
    lens = [1, 63, 64, 65, 4096, 0, 1000, 16384 - 7]
    key_dtype = torch.bfloat16
    q, w, keys, table, n = make_case(len(lens), 64, 128, 64, 300, lens, dtype=key_dtype, device="cuda", seed=2)
    out = torch.full((len(lens), 300 * 64), POISON, device="cuda")
    if dtype == "fp8":
        k8 = quantize_keys(keys)
        ref = indexer_fp8_ref(q, w, k8, table, n)
        got = indexer_fp8_triton(q, w, k8, table, n, out=out)
    else:
        ref = indexer_ref(q, w, keys, table, n)
        got = indexer_triton(q, w, keys, table, n, out=out)
    torch.cuda.synchronize()
    check_against_ref(got, ref, lens, TOLERANCE[dtype])


@cuda
@pytest.mark.gpu
def test_gpu_graph_captured_at_max_replays_at_any_length():
    max_pages, batch = 64, 4
    q, w, keys, table, n = make_case(batch, 64, 128, 64, max_pages, [max_pages * 64] * batch, torch.bfloat16, "cuda")
    out = torch.full((batch, max_pages * 64), POISON, device="cuda")
    indexer_triton(q, w, keys, table, n, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_triton(q, w, keys, table, n, out=out)
    for lens in ([1, 2, 3, 4], [4096, 0, 65, 4000], [64, 128, 129, 2047], [4096] * 4):
        out.fill_(POISON)
        n.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        check_against_ref(out, indexer_ref(q, w, keys, table, n), lens, TOLERANCE[torch.bfloat16])
