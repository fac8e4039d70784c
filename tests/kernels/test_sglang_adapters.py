"""The SGLang adapters on CPU: their reference paths, the geometry-aware Triton kernel under the
interpreter (fp32 dots: the 3.9 interpreter computes bf16 tl.dot wrong), and their refusals."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4_cluster.kernels.indexer.fp8_keys import dequantize_keys
from dsv4_cluster.kernels.sglang_adapters import (
    AdapterCallError,
    flash_mla_with_kvcache,
    fp8_paged_mqa_logits,
    topk_transform_paged_v2,
)
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, sparse_mla_decode_ref
from dsv4_cluster.kernels.topk.page_transform import page_transform, page_transform_ref
from dsv4_cluster.kernels.sglang_cases import LAYERS, decode_case, indexer_case

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _dense_reference(args: dict, h: int):
    """sparse_mla_decode_ref over fully dequantised caches (independent of the adapter's slot gather)."""
    def rows(view):
        tokens = view.shape[1]
        pages = torch.as_strided(view.view(torch.uint8), (view.shape[0], view.stride(0)), (view.stride(0), 1))
        return fp8_layout.dequantize_kv_v4(pages.contiguous(), tokens)

    extra = args.get("extra_k_cache")
    return sparse_mla_decode_ref(
        args["q"][:, 0, :h], rows(args["k_cache"]), args["indices"][:, 0],
        rows(extra) if extra is not None else None,
        args["extra_indices_in_kvcache"][:, 0] if extra is not None else None,
        args["attn_sink"][:h], args["softmax_scale"], args["topk_length"], args.get("extra_topk_length"))


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("real_heads", [16, 64])
def test_flash_mla_adapter_reference_path(kind, real_heads):
    args = decode_case(kind, 3, real_heads, device="cpu", window_tokens=1024, extra_tokens=512)
    out, lse = flash_mla_with_kvcache(tile_scheduler_metadata=None, real_heads=real_heads, **args)
    assert out.shape == (3, 1, 64, 512) and out.dtype == torch.bfloat16 and lse.shape == (3, 64, 1)
    ref_out, ref_lse = _dense_reference(args, real_heads)
    torch.testing.assert_close(out[:, 0, :real_heads].float(), ref_out.float(), atol=0, rtol=0)
    torch.testing.assert_close(lse[:, :real_heads, 0], ref_lse)


@pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernel through the CPU interpreter")
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_triton_kernel_with_sglang_page_geometry(kind):
    """Window pages of 256 tokens with ratio-4 (64) or ratio-128 (2) extra pages, h = 16 of 64."""
    from dsv4_cluster.kernels.sglang_adapters.flash_mla import cache_geometry
    from dsv4_cluster.kernels.sparse_mla_decode.launch import LaunchConfig, sparse_decode_paged

    args = decode_case(kind, 2, 16, device="cpu", window_tokens=1024, extra_tokens=512)
    if "extra_k_cache" in args:  # keep the interpreter's grid small: 64 extra rows
        args["extra_indices_in_kvcache"] = args["extra_indices_in_kvcache"][..., :64].contiguous()
        args["extra_topk_length"] = args["extra_topk_length"].clamp(max=64)
    h = 16
    out = torch.zeros(2, h, 512, dtype=torch.bfloat16)
    lse = torch.zeros(2, h)
    window = (args["k_cache"].view(torch.uint8), cache_geometry(args["k_cache"], "k"), args["indices"][:, 0],
              args["topk_length"])
    extra = None
    if "extra_k_cache" in args:
        extra = (args["extra_k_cache"].view(torch.uint8), cache_geometry(args["extra_k_cache"], "e"),
                 args["extra_indices_in_kvcache"][:, 0], args["extra_topk_length"])
    sparse_decode_paged(args["q"][:, 0, :h], window, extra, args["attn_sink"][:h], args["softmax_scale"], out, lse,
                        config=LaunchConfig(backend="triton", num_splits=2))
    ref_out, ref_lse = _dense_reference(args, h)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("change, match", [
    (dict(q=lambda a: a["q"].expand(-1, 2, -1, -1)), "s_q = 2"),
    (dict(indices=lambda a: None), "dense decode"),
    (dict(use_legacy=lambda a: False), "use_legacy=False"),
    (dict(is_fp8_kvcache=lambda a: False), "is_fp8_kvcache"),
    (dict(k_cache=lambda a: torch.zeros(4, 64, 1, 528, dtype=torch.uint8)), "V4.1"),
    (dict(topk_length=lambda a: a["topk_length"].long()), "topk_length"),
    (dict(extra_k_cache=lambda a: None), "go together"),
    (dict(attn_sink=lambda a: a["attn_sink"][:16]), "attn_sink"),
    (dict(real_heads=lambda a: 65), "real_heads"),
])
def test_flash_mla_adapter_refuses_what_it_does_not_compute(change, match):
    args = decode_case("c4", 2, device="cpu", window_tokens=512, extra_tokens=256)
    args.update({k: f(args) for k, f in change.items()})
    with pytest.raises(AdapterCallError, match=match):
        flash_mla_with_kvcache(tile_scheduler_metadata=None, **args)


def _stock_logits(c: dict) -> torch.Tensor:
    """DeepGEMM's formula in plain torch (SGLang's fp8_paged_mqa_logits_torch, restated): -inf past lens."""
    dim = c["q"].shape[-1]
    keys = dequantize_keys(c["kv"].view(c["kv"].shape[0], -1), dim)  # [P, 64, Di]
    rows = c["q"].shape[0]
    out = torch.full((rows, c["capacity"]), float("-inf"))
    for r in range(rows):
        n = int(c["lens"][r])
        if n:
            k = keys[c["table"][r, : -(-n // 64)].long()].reshape(-1, dim)[:n]
            out[r, :n] = (torch.relu(c["q"][r, 0].float() @ k.T) * c["weights"][r, :, None]).sum(0)
    return out


def test_indexer_and_topk_adapters_reference_path():
    lens = [0, 1, 100, 512, 513, 1500]
    c = indexer_case(len(lens), lens, capacity=2048, device="cpu")
    logits = fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, 2048, False)
    assert logits.shape == (len(lens), 2048) and logits.dtype == torch.float32
    expect = _stock_logits(c)
    for r, n in enumerate(lens):
        torch.testing.assert_close(logits[r, :n], expect[r, :n], rtol=1e-4, atol=1e-4)
    out = torch.full((len(lens), 512), -7, dtype=torch.int32)
    raw = torch.full_like(out, -7)
    topk_transform_paged_v2(logits, c["lens"], c["table"], out, 64, None, raw)
    for r, n in enumerate(lens):
        picked = raw[r][raw[r] >= 0]
        assert (raw[r] >= 0).sum() == min(n, 512) and (raw[r][min(n, 512):] == -1).all()
        want = set(range(n)) if n <= 512 else set(torch.topk(logits[r, :n], 512).indices.tolist())
        assert set(picked.tolist()) == want
        slots = out[r][: min(n, 512)].long()
        expect_slots = c["table"][r].long()[picked.long() // 64] * 64 + picked.long() % 64
        assert torch.equal(slots, expect_slots) and (out[r][min(n, 512):] == -1).all()


def test_indexer_adapter_refuses_clean_logits_and_next_n():
    c = indexer_case(2, [10, 20], capacity=128, device="cpu")
    with pytest.raises(AdapterCallError, match="clean_logits"):
        fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, 128, True)
    with pytest.raises(AdapterCallError, match="next_n"):
        fp8_paged_mqa_logits(c["q"].expand(-1, 2, -1, -1), c["kv"], c["weights"], c["lens2d"], c["table"], None,
                             128, False)
    with pytest.raises(AdapterCallError, match="page_size"):
        topk_transform_paged_v2(torch.zeros(2, 128), c["lens"], c["table"], torch.zeros(2, 512, dtype=torch.int32),
                                48, None)


@pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernel through the CPU interpreter")
def test_page_transform_kernel_matches_reference():
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, 640, (3, 512), generator=gen, dtype=torch.int32)
    table = torch.randint(0, 1000, (3, 10), generator=gen, dtype=torch.int32)
    out, raw = torch.empty_like(idx), torch.empty_like(idx)
    page_transform(idx, table, 6, out, raw)
    assert torch.equal(out, page_transform_ref(idx, table, 6)) and torch.equal(raw, idx)
    page_transform(idx, None, 6, out)
    assert torch.equal(out, idx)
