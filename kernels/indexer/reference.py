"""Reference indexer in plain torch: the definition the Triton kernel is tested against.

DeepSeek-V4's CSA layers pick, per decode query, 512 of the L/4 compressed (ratio-4) KV entries. The
indexer scores every live entry: score[t] = sum_h relu(q_h . k_t) * w_h. This file states that
formula as directly as possible, on any float dtype and any sizes (the embedded CPU engine runs it
with float32, 4 heads of 32 dims and 4 entries per page), computing in float32.
"""

from __future__ import annotations

import torch

from dsv4_cluster.kernels.indexer.fp8_keys import dequantize_keys
from dsv4_cluster.kernels.indexer.shapes import check_indexer_inputs


def indexer_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Indexer scores of every live compressed entry, -inf past each request's live length.

    Shapes (B requests, Hi heads, Di dims, P physical pages, E entries per page):
      q           [B, Hi, Di]    any float dtype
      weights     [B, Hi]        any float dtype (float32 in the engine)
      k_cache     [P, E, Di]     same float dtype family as q (computed in float32)
      page_table  [B, max_pages] int32/int64: physical page of logical page j of request b
      lens        [B]            int32/int64: live entries of request b, 0 <= lens[b] <= max_pages*E
    Returns float32 [B, max_pages*E]: score[b, t] = sum_h relu(q[b,h] . k[b,t]) * weights[b,h] for
    t < lens[b], where k[b,t] = k_cache[page_table[b, t // E], t % E]; -inf for t >= lens[b].
    Page-table entries past a request's live pages are never read (they may hold anything).
    """
    check_indexer_inputs(q, weights, k_cache, page_table, lens, key_kind="float")
    return _scores(q.float(), weights.float(), k_cache.float(), page_table, lens)


def indexer_fp8_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache_fp8: torch.Tensor,
    page_table: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """`indexer_ref` on fp8 keys: k_cache_fp8 is uint8 [P, E*(Di+4)] in the layout of `fp8_keys`.

    Each page holds E rows of Di e4m3 bytes, then E float32 scales; a key is fp8 value * its scale.
    The other shapes and the result are those of `indexer_ref`.
    """
    check_indexer_inputs(q, weights, k_cache_fp8, page_table, lens, key_kind="fp8")
    keys = dequantize_keys(k_cache_fp8, q.shape[-1])
    return _scores(q.float(), weights.float(), keys, page_table, lens)


def _scores(q, w, keys, page_table, lens) -> torch.Tensor:
    batch, max_pages = page_table.shape
    per_page = keys.shape[1]
    out = torch.full((batch, max_pages * per_page), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        pages = page_table[b, : (n + per_page - 1) // per_page].long()
        k = keys[pages].reshape(-1, keys.shape[-1])[:n]  # [n, Di]
        logits = torch.relu(q[b] @ k.T)  # [Hi, n]
        out[b, :n] = (logits * w[b, :, None]).sum(0)
    return out
