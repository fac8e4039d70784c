"""Inputs shaped as SGLang 0.5.23 hands them to the three adapted calls, shared by tests and bench.

Sparse decode: the window cache in 256-token pages (149,760 B), a ratio-4 extra cache in 64-token pages
with a top-512 list, a ratio-128 extra cache in 2-token pages with a capacity-sized list (512 wide),
q [B, 1, 64, 512] bf16 whose heads past `real_heads` hold garbage (SGLang pads them uninitialised).
"""

from __future__ import annotations

import functools

import torch

from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout

WINDOW = 128
LAYERS = {"window": None, "c4": (64, 512), "c128": (2, 512)}  # extra cache: page tokens, list width
HEADS = 64
DIM = 512


@functools.lru_cache(maxsize=8)
def _cache(tokens: int, page_tokens: int, device):
    """A V4 cache of `tokens` random rows in pages of `page_tokens` (read-only: shared between cases)."""
    gen = torch.Generator(device=device).manual_seed(tokens + page_tokens)
    kv = torch.randn(tokens, DIM, generator=gen, device=device)
    cache = fp8_layout.quantize_kv_v4(kv, page_tokens)
    return cache, fp8_layout.flashmla_view(cache, page_tokens)


def _list(b: int, width: int, tokens: int, gen, device, full: bool, min_len: int):
    idx = torch.randint(0, tokens, (b, 1, width), generator=gen, dtype=torch.int32)
    holes = torch.rand(b, 1, width, generator=gen) < 0.05
    idx[holes] = -1
    lens = torch.full((b,), width, dtype=torch.int32) if full else torch.randint(min_len, width + 1, (b,), generator=gen,
                                                                                   dtype=torch.int32)
    return idx.to(device), lens.to(device)


def decode_case(kind: str, b: int, real_heads: int = HEADS, device="cuda", seed: int = 0, full: bool = False,
                window_tokens: int = 8192, extra_tokens: int = 8192) -> dict:
    """Keyword arguments of SGLang's `flash_mla_with_kvcache` call for one layer kind (+ 'real_heads')."""
    gen = torch.Generator().manual_seed(seed)
    _, k_view = _cache(window_tokens, 256, str(device))
    q = torch.randn(b, 1, HEADS, DIM, generator=gen)
    q[:, :, real_heads:] *= 40.0  # padding rows: garbage that must not leak into the real heads
    indices, topk_length = _list(b, WINDOW, window_tokens, gen, device, full, 1)
    args = dict(q=q.to(torch.bfloat16).to(device), k_cache=k_view, block_table=None, cache_seqlens=None,
                head_dim_v=DIM, softmax_scale=DIM**-0.5, is_fp8_kvcache=True, indices=indices,
                topk_length=topk_length, attn_sink=torch.randn(HEADS, generator=gen).to(device))
    if LAYERS[kind] is not None:
        page_tokens, width = LAYERS[kind]
        _, e_view = _cache(extra_tokens, page_tokens, str(device))
        e_idx, e_len = _list(b, width, extra_tokens, gen, device, full, 0)
        args.update(extra_k_cache=e_view, extra_indices_in_kvcache=e_idx, extra_topk_length=e_len)
    return args


def live_rows(args: dict) -> int:
    """Rows the call reads (window + extra list positions below their lengths), for bandwidth figures."""
    n = int(args["topk_length"].sum())
    if "extra_topk_length" in args:
        n += int(args["extra_topk_length"].sum())
    return n


def indexer_case(b: int, lens: list[int], capacity: int, device="cuda", seed: int = 0, heads: int = 64,
                 dim: int = 128) -> dict:
    """Positional arguments of DeepGEMM's `fp8_paged_mqa_logits` as SGLang passes them (and the 1-D lens).

    Each row's live pages are distinct random pool pages; the page table is `capacity` entries wide."""
    from dsv4_cluster.kernels.indexer.fp8_keys import quantize_keys

    gen = torch.Generator().manual_seed(seed)
    per_page = 64
    live_pages = [-(-n // per_page) for n in lens]
    pool = max(1, sum(live_pages))
    device_gen = torch.Generator(device=device).manual_seed(seed)
    keys = quantize_keys(torch.randn(pool, per_page, dim, generator=device_gen, device=device))
    table = torch.zeros(b, capacity // per_page, dtype=torch.int32)
    perm = torch.randperm(pool, generator=gen).to(torch.int32)
    start = 0
    for r, n in enumerate(live_pages):
        table[r, :n] = perm[start:start + n]
        start += n
    q = (torch.randn(b, 1, heads, dim, generator=gen) * 2).to(torch.float8_e4m3fn)
    weights = torch.randn(b, heads, generator=gen) * 0.1
    seq = torch.tensor(lens, dtype=torch.int32)
    return dict(q=q.to(device), kv=keys.view(pool, per_page, 1, dim + 4), weights=weights.to(device),
                lens2d=seq[:, None].to(device), lens=seq.to(device), table=table.to(device), capacity=capacity)


# SGLang's sm_120 branch: the keywords it passes `flash_mla_with_kvcache_sm120`
SM120_KW = ("q", "k_cache", "head_dim_v", "softmax_scale", "indices", "topk_length", "attn_sink", "extra_k_cache",
            "extra_indices_in_kvcache", "extra_topk_length")


def sm120_call(args: dict, heads: int | None = None) -> dict:
    """The keywords SGLang's sm_120 branch passes (q and sink sliced to `heads` as above 64 rows)."""
    kw = {k: v for k, v in args.items() if k in SM120_KW}
    if heads is not None:
        kw["q"], kw["attn_sink"] = kw["q"][:, :, :heads].contiguous(), kw["attn_sink"][:heads]
    return kw


def sglang_sm120_args(kw: dict) -> tuple:
    """The positional arguments of SGLang's sm_120 Triton kernel and PyTorch fallback for the same call."""
    return (kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["head_dim_v"],
            kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices_in_kvcache"), kw.get("extra_topk_length"))
