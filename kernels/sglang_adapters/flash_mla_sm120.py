"""`flash_mla_with_kvcache_sm120` with the keyword-only call SGLang 0.5.23 makes on sm_120, on our kernel.

SGLang's `_forward_attention` (`get_platform().is_sm120` branch) calls it with q [B, 1, H, 512] bf16, the window
cache view [pages, 256, 1, 584], indices [B, 1, W], topk_length, attn_sink [H] float32, and on compressed layers
the extra cache, extra_indices_in_kvcache, extra_topk_length; head_dim_v and softmax_scale. H is 64 (the pad) at
most `SM120_DECODE_MAX_TOKENS` rows, or where FlashInfer takes the real head count; above, SGLang has already
sliced q and the sink to the real heads (16 at TP4, 8 at TP8). Every such call is ours: a head count the kernel
does not compute (8) is padded with zero heads to 16, computed, and sliced back. Where the plugin's class hook
knows the layer's real head count (`routing.real_heads`, from `layer.tp_q_head_num`), only those heads of a
padded q are computed; the pad's rows are left unwritten (SGLang slices them off).

Returns (out [B, 1, H, 512] bf16, softmax_lse [B, H, 1] float32) as FlashMLA does (SGLang reads only out; its
Triton path returns the sink-merged lse, FlashInfer's None).
"""

from __future__ import annotations


from ..sglang_plugin.routing import real_heads
from .errors import fail
from .flash_mla import DIM, KERNEL_HEADS, flash_mla_with_kvcache

SM120_KWARGS = frozenset(("q", "k_cache", "head_dim_v", "softmax_scale", "indices", "topk_length", "attn_sink",
                          "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length"))


def flash_mla_with_kvcache_sm120(**kwargs):
    """SGLang's sm_120 sparse-decode entry (keywords as `SM120_KWARGS`) on our kernel; see the module docstring."""
    unknown = set(kwargs) - SM120_KWARGS
    if unknown:
        fail(f"flash_mla_with_kvcache_sm120 got keywords SGLang 0.5.23 does not pass: {', '.join(sorted(unknown))}")
    q, sink = kwargs["q"], kwargs.get("attn_sink")
    if q.dim() != 4:
        fail(f"q must be [B, 1, H, {DIM}]; got shape {list(q.shape)}")
    heads = q.shape[2]
    real = real_heads()
    told = real if real in KERNEL_HEADS and real < heads else None
    padded = next((h for h in KERNEL_HEADS if h >= heads), None)
    if padded is None:
        fail(f"q has {heads} heads; the kernel computes at most {KERNEL_HEADS[-1]}")
    if padded != heads:
        q_pad = q.new_zeros(q.shape[0], q.shape[1], padded, q.shape[3])
        q_pad[:, :, :heads] = q
        q = q_pad
        if sink is not None:
            sink_pad = sink.new_zeros(padded)
            sink_pad[:heads] = sink
            sink = sink_pad
    out, lse = flash_mla_with_kvcache(**flash_mla_keywords(kwargs, q, sink), real_heads=told)
    if padded != heads:
        return out[:, :, :heads], lse[:, :heads]
    return out, lse


def flash_mla_keywords(kwargs: dict, q, sink) -> dict:
    """`flash_mla_with_kvcache`'s keywords for an sm_120 call's `kwargs`, with q and the sink as given (padded)."""
    return dict(q=q, k_cache=kwargs["k_cache"], block_table=None, cache_seqlens=None, head_dim_v=kwargs["head_dim_v"],
                tile_scheduler_metadata=None, softmax_scale=kwargs.get("softmax_scale"), is_fp8_kvcache=True,
                indices=kwargs["indices"], attn_sink=sink, extra_k_cache=kwargs.get("extra_k_cache"),
                extra_indices_in_kvcache=kwargs.get("extra_indices_in_kvcache"), topk_length=kwargs.get("topk_length"),
                extra_topk_length=kwargs.get("extra_topk_length"), use_legacy=True)


__all__ = ["SM120_KWARGS", "flash_mla_keywords", "flash_mla_with_kvcache_sm120"]
