"""Top-k: radix-select kernel against the torch reference; index outputs compared exactly, as sets."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.topk.radix_select import topk_triton, workspace_size
from dsv4_cluster.kernels.topk.reference import TopkInputError, topk_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The small-shape kernel tests run compiled on a GPU when there is one, else in the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_sets(got: torch.Tensor, ref: torch.Tensor, lens) -> None:
    assert got.shape == ref.shape and got.dtype == torch.int32
    k = ref.shape[1]
    for b, n in enumerate(lens):
        row = got[b].tolist()
        winners = [i for i in row if i >= 0]
        assert len(winners) == min(k, n) and row.count(-1) == k - min(k, n), f"row {b}: wrong count or padding"
        assert len(set(winners)) == len(winners), f"row {b}: an index appears twice"
        assert set(winners) == set(ref[b, : min(k, n)].tolist()), f"row {b} (len {n}): different set"


def poisoned_scores(batch, width, lens, seed=0, device="cpu"):
    """Random scores; NaN past each live prefix, so any read of the tail would corrupt the result."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, width, generator=g)
    s[torch.arange(width)[None, :] >= torch.tensor(lens)[:, None]] = float("nan")
    return s.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def test_reference_order_and_tie_rule():
    s = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 2.0, 9.0]])
    idx = topk_ref(s, torch.tensor([6], dtype=torch.int32), 4)  # 9.0 at t=6 is past the live length
    assert idx.tolist() == [[1, 2, 5, 0]]
    idx = topk_ref(s, torch.tensor([5], dtype=torch.int32), 4)  # -0.0 ties +0.0: the lower index wins
    assert idx.tolist() == [[1, 2, 0, 3]]
    assert topk_ref(s, torch.tensor([2], dtype=torch.int32), 4).tolist() == [[1, 0, -1, -1]]


# One launch with a per-row barrier needs programs running concurrently: the interpreter runs them
# one after another, so there it is tested with one program per row; the per-pass variant with three.
VARIANTS = [dict(one_launch=False, split=3), dict(one_launch=True, split=1 if DEVICE == "cpu" else 3)]


@pytest.mark.parametrize("variant", VARIANTS, ids=["per_pass", "one_launch"])
@pytest.mark.parametrize("k", [1, 7, 37, 64])
def test_triton_matches_reference_ragged(k, variant):
    lens = [0, 1, 20, 64, 65, 300, 513]
    s, n = poisoned_scores(len(lens), 520, lens, seed=k, device=DEVICE)
    assert_same_sets(topk_triton(s, n, k, block=64, **variant), topk_ref(s, n, k), lens)


@pytest.mark.parametrize("variant", VARIANTS, ids=["per_pass", "one_launch"])
def test_triton_heavy_ties_and_signed_zeros(variant):
    lens = [400, 399, 350]
    s, n = poisoned_scores(3, 400, lens, seed=5, device=DEVICE)
    s[0, :400] = torch.round(s[0, :400] * 2) / 2  # a handful of distinct values
    s[1, :399] = 0.0
    s[1, 1:399:3] = -0.0  # signed zeros tie with zeros: the lowest indices win
    s[2, :350] = torch.randn(350, device=DEVICE).abs() * 1e-30 - 1e30  # all negative, nearly equal
    for k in (5, 33, 100):
        assert_same_sets(topk_triton(s, n, k, block=128, **variant), topk_ref(s, n, k), lens)


def test_bf16_scores_and_preallocated_out_and_workspace():
    lens = [100, 3]
    s, n = poisoned_scores(2, 128, lens, seed=3, device=DEVICE)
    s = s.to(torch.bfloat16)  # bf16 rounding makes ties common
    out = torch.full((2, 40), 77, dtype=torch.int32, device=DEVICE)
    ws = torch.full((workspace_size(2),), 9, dtype=torch.int32, device=DEVICE)
    got = topk_triton(s, n, 40, out=out, workspace=ws, block=32, one_launch=False, split=2)
    assert got.data_ptr() == out.data_ptr()
    assert_same_sets(got, topk_ref(s, n, 40), lens)


def test_bad_inputs_name_the_problem():
    s, n = poisoned_scores(2, 50, [50, 10])
    with pytest.raises(TopkInputError, match=r"lens must lie in \[0, N\] = \[0, 50\]"):
        topk_ref(s, torch.tensor([51, 0], dtype=torch.int32), 8)
    with pytest.raises(TopkInputError, match="k must be a positive int"):
        topk_ref(s, n, 0)
    with pytest.raises(TopkInputError, match="NaN"):
        topk_ref(torch.full((2, 50), float("nan")), n, 8)
    if DEVICE == "cpu":
        with pytest.raises(TopkInputError, match="one_launch needs split=1"):
            topk_triton(s, n, 8, one_launch=True, split=2)
    with pytest.raises(TopkInputError, match="workspace"):
        topk_triton(s, n, 8, workspace=torch.zeros(3, dtype=torch.int32), one_launch=False)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [True, False])
def test_gpu_k512_very_ragged_batch(one_launch):
    lens = [0, 1, 511, 512, 513, 4096, 65536, 100_000, 262_144, 7, 30_000, 2048]
    s, n = poisoned_scores(len(lens), 262_144, lens, seed=11, device="cuda")
    s[3, :512] = 1.0  # a row of equal scores exactly k long
    s[10, :30_000] = torch.round(s[10, :30_000] * 8) / 8  # ties across the pivot
    assert_same_sets(topk_triton(s, n, 512, one_launch=one_launch).cpu(), topk_ref(s, n, 512).cpu(), lens)


@cuda
@pytest.mark.gpu
def test_gpu_graph_captured_at_max_width_replays_at_many_lengths():
    batch, width, k = 8, 1 << 18, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(batch, width, device="cuda", generator=g)
    n = torch.full((batch,), width, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, k, dtype=torch.int32, device="cuda")
    ws = torch.zeros(workspace_size(batch), dtype=torch.int32, device="cuda")
    topk_triton(s, n, k, out=out, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_triton(s, n, k, out=out, workspace=ws)
    for lens in ([1, 0, 511, 512, 513, 1000, 5, 70_000], [width] * batch, [4096 * (i + 1) for i in range(batch)]):
        n.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        assert_same_sets(out.cpu(), topk_ref(s, n, k).cpu(), lens)


COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_cluster.kernels.topk.radix_select import _topk_one_launch_kernel
sig = {"scores_ptr": "*fp32", "stride_sb": "i32", "lens_ptr": "*i32", "hist_ptr": "*i32", "bar_ptr": "*i32",
       "count_ptr": "*i32", "out_ptr": "*i32", "stride_ob": "i32", "k": "i32", "width": "i32", "batch": "i32",
       "split": "i32", "BLOCK": "constexpr", "K_BLOCK": "constexpr"}
src = ASTSource(_topk_one_launch_kernel, sig, constexprs={"BLOCK": 1024, "K_BLOCK": 512})
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
print("COMPILED", sorted(k for k, v in compiled.asm.items() if v))
"""


def test_one_launch_kernel_compiles_for_sm90_without_a_gpu():
    """The one-launch kernel (a per-row barrier) runs on GPUs only, never in the interpreter: compile it for
    sm_90 here, to cubin, in a child without TRITON_INTERPRET, so a frontend error (a non-constexpr global read
    in a @jit function once broke it on the H200 alone) fails in CI."""
    from tests.zygote import compile_child

    code, stdout, stderr = compile_child(COMPILE_SM90, timeout_s=240)
    assert code == 0, stderr[-3000:]
    assert "'cubin'" in stdout and "'ptx'" in stdout, stdout
