"""The sm_120 decode entry: our adapter against SGLang's own sm_120 fallbacks on the same inputs.

CPU (CI): the adapter's reference path equals SGLang's PyTorch fallback `_sm120_sparse_decode_fwd` (its source,
unmodified) on SGLang's page layout, with 64 heads and with 8 (the TP8 slice above SM120_DECODE_MAX_TOKENS rows).
GPU, sm_120 forced (`DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1`, an H200 standing in): our kernel with the
sm_120 rows of the dispatch table equals SGLang's sm_120 Triton kernel and FlashMLA's semantics (the fp32
reference FlashMLA was checked against), and every kernel compiled on the way fits sm_120's 99 KB.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.sm120_decode import load
from dsv4_cluster.kernels import dispatch
from dsv4_cluster.kernels.sglang_adapters import flash_mla_with_kvcache_sm120
from dsv4_cluster.kernels.sglang_cases import decode_case, sglang_sm120_args, sm120_call
from tests.sglang_support import require_sglang

FORCED = os.environ.get(dispatch.CLASS_ENV) == "sm_120"
@pytest.mark.parametrize("kind", ["window", "c4", "c128"])
@pytest.mark.parametrize("heads", [None, 8])
def test_cpu_adapter_equals_sglangs_torch_fallback(kind, heads):
    require_sglang()
    base = load()
    kw = sm120_call(decode_case(kind, 3, device="cpu", window_tokens=1024, extra_tokens=512, seed=7), heads)
    ours = flash_mla_with_kvcache_sm120(**kw)[0].float()
    theirs = base.torch_decode(*sglang_sm120_args(kw))[0].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= theirs.abs().max().item() / 128  # both bf16 outputs of fp32 math


gpu_forced = pytest.mark.skipif(not (torch.cuda.is_available() and FORCED),
                                reason="needs CUDA with DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1")


@pytest.mark.gpu
@gpu_forced
@pytest.mark.parametrize("kind", ["window", "c4", "c128"])
@pytest.mark.parametrize("b", [1, 8, 64, 128])
def test_gpu_forced_sm120_equals_sglangs_triton_and_flashmla_semantics(kind, b):
    from dsv4_cluster.kernels.sglang_adapters.flash_mla import cache_geometry, reference_decode

    assert dispatch.class_of_device(torch.device("cuda")) == "sm_120"
    base = load()
    args = decode_case(kind, b, 16, seed=b)
    kw = sm120_call(args, 16 if b > 64 else None)  # SGLang's convention: the pad sliced off above 64 rows
    ours = flash_mla_with_kvcache_sm120(**kw)[0].float()
    theirs = base.triton_decode(*sglang_sm120_args(kw))[0].float()
    h = kw["q"].shape[2]
    window = (kw["k_cache"].view(torch.uint8), cache_geometry(kw["k_cache"], "k"), kw["indices"][:, 0], kw["topk_length"])
    extra = None
    if "extra_k_cache" in kw:
        extra = (kw["extra_k_cache"].view(torch.uint8), cache_geometry(kw["extra_k_cache"], "e"),
                 kw["extra_indices_in_kvcache"][:, 0], kw["extra_topk_length"])
    ref, _ = reference_decode(kw["q"][:, 0].float(), window, extra, kw["attn_sink"], kw["softmax_scale"])
    scale = ref.abs().max().item()
    assert (ours[:, 0] - ref).abs().max().item() <= scale / 128
    assert (ours - theirs).abs().max().item() <= scale / 64, h


@pytest.mark.gpu
@gpu_forced
@pytest.mark.parametrize("kind", ["c4", "c128"])
@pytest.mark.parametrize("rows", [1024, 4096])
def test_gpu_forced_sm120_prefill_rows_equal_sglangs_torch_path(kind, rows):
    """On sm_120 SGLang sends every prefill / extend chunk through the same entry (its sparse prefill is off there):
    thousands of rows with q sliced to the real heads (16 at TP4). Ours equals SGLang's PyTorch path on them."""
    base = load()
    kw = sm120_call(decode_case(kind, rows, 16, seed=rows), 16)
    ours = flash_mla_with_kvcache_sm120(**kw)[0].float()
    theirs = base.torch_decode(*sglang_sm120_args(kw))[0].float()
    assert ours.shape == theirs.shape == (rows, 1, 16, 512)
    assert (ours - theirs).abs().max().item() <= theirs.abs().max().item() / 128


@pytest.mark.gpu
@gpu_forced
def test_gpu_forced_sm120_kernels_fit_99_kb_and_never_the_wgmma_kernel():
    from dsv4_cluster.kernels import fast_launch
    from dsv4_cluster.kernels.sglang_adapters import fp8_paged_mqa_logits, topk_transform_paged_v2
    from dsv4_cluster.kernels.sparse_mla_decode.config import LaunchConfig, choose_backend
    from dsv4_cluster.kernels.sglang_cases import indexer_case

    dev = torch.device("cuda")
    for heads in (16, 32, 64):
        backend, config = choose_backend(dev, heads, torch.bfloat16, True, LaunchConfig())
        row = dispatch.decode_impl("sm_120", heads)
        assert (backend, config.block_n, config.num_stages) == (row.backend, row.block_n, row.num_stages)
        assert backend in ("triton", "gluon_mma_v2")
    for kind in ("window", "c4", "c128"):
        for b in (1, 8, 128):
            kw = sm120_call(decode_case(kind, b, 16, seed=3), 16 if b > 64 else None)
            flash_mla_with_kvcache_sm120(**kw)
    c = indexer_case(4, [0, 300, 5000, 70000], capacity=1 << 17)
    logits = fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, 1 << 17, False)
    out = torch.empty(4, 512, dtype=torch.int32, device="cuda")
    topk_transform_paged_v2(logits, c["lens"], c["table"], out, 64, None, torch.empty_like(out))
    torch.cuda.synchronize()
    shared = [(getattr(k[0], "__name__", str(k[0])), h.metadata.shared) for k, h in fast_launch._HANDLES.items()]
    assert shared and "_sparse_decode_ws_kernel" not in {name for name, _ in shared}
    over = [(name, s) for name, s in shared if s > dispatch.SMEM_PER_BLOCK["sm_120"]]  # every specialization
    assert not over, over
    print("shared memory per compiled kernel (B):", shared)
