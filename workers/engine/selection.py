"""The indexer + top-k rule as whole-tensor torch ops, every row at once, equal to the kernels' references (the
same formula and tie rule); used for prefill chunks, and for decode where the kernels are off.
"""

from __future__ import annotations

import torch

from ..kv.fp8 import read_key_pages
from ..kv.layout import KEY_SCALE_BYTES


def select_shared_table(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                         live: torch.Tensor, k: int) -> torch.Tensor:
    """`topk(indexer(...))` for rows of one request (one page table), as whole-tensor ops.

    The kernels' CPU reference loops over rows in Python, which made a forward cost O(rows)
    interpreter steps per layer; here all rows of a prompt chunk are scored at once. Same formula and
    rule: score[t, e] = sum_h relu(q[t,h] . key_e) * w[t,h] for e < live[t], the k best by (descending
    score, ascending index), -1 padded (tests/workers/test_prefill_batching.py checks that the result equals
    the kernels' reference exactly).
    q [T, Hi, Di]; w [T, Hi]; keys [P, E, Di] float, or the fp8 key pages uint8 [P, E * (Di + 4)] (only the
    live pages are dequantised); table [max_pages]; live [T] -> int32 [T, k].
    """
    n = int(live.max()) if live.numel() else 0
    if n == 0:
        return torch.full((q.shape[0], k), -1, dtype=torch.int32, device=q.device)
    dim = q.shape[-1]
    per_page = _per_page(keys, dim)
    kk = _key_pages(keys, table[: (n + per_page - 1) // per_page], dim).reshape(-1, dim)[:n].float()
    return _top(torch.relu(q.float() @ kk.T), w, live, k)


def select_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
                 live: torch.Tensor, k: int) -> torch.Tensor:
    """`select_shared_table` for rows with a page table each (a decode batch): tables [T, max_pages]."""
    n = int(live.max()) if live.numel() else 0
    if n == 0:
        return torch.full((q.shape[0], k), -1, dtype=torch.int32, device=q.device)
    dim = q.shape[-1]
    per_page = _per_page(keys, dim)
    pages = tables[:, : (n + per_page - 1) // per_page].clamp(min=0).long()
    kk = _key_pages(keys, pages, dim).reshape(q.shape[0], -1, dim)[:, :n].float()      # [T, n, Di]
    return _top(torch.relu(q.float() @ kk.transpose(1, 2)), w, live, k)


def _top(logits: torch.Tensor, w: torch.Tensor, live: torch.Tensor, k: int) -> torch.Tensor:
    """relu'd logits [T, Hi, n] -> the k best live entries per row by the weighted head sum, -1 padded."""
    scores = (logits * w.float()[:, :, None]).sum(1)                                  # [T, n]
    n = scores.shape[1]
    scores = scores.masked_fill(torch.arange(n, device=scores.device)[None, :] >= live[:, None], float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k].to(torch.int32)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    out[:, : order.shape[1]] = order.masked_fill(order >= live[:, None], -1)
    return out


def _per_page(keys: torch.Tensor, dim: int) -> int:
    return keys.shape[1] // (dim + KEY_SCALE_BYTES) if keys.dtype == torch.uint8 else keys.shape[1]


def _key_pages(keys: torch.Tensor, pages: torch.Tensor, dim: int) -> torch.Tensor:
    """Keys [*pages.shape, E, Di] of `pages`: float keys indexed, fp8 key pages dequantised (those pages only)."""
    if keys.dtype == torch.uint8:
        return read_key_pages(keys, dim, pages)
    return keys[pages.long()]
