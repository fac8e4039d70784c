"""A tiny DeepSeek-V4-shaped model with seeded random weights: the embedded engine's compute.

What it shares with DeepSeek-V4: one shared KV head (MQA) whose value is its key (V = K), RoPE on the
last `rope_dim` dims, a sliding window of recent tokens, ratio-4 compressed entries of which an
indexer (`score = Σ_h relu(q_h·k)·w_h`) picks the top-k, and a per-head attention sink. Attention
goes through `dsv4_cluster.kernels` (reference ops on CPU, Triton on CUDA), so the engine is also
the kernels' end-to-end test bed. What it leaves out: MoE, hyper-connections, multi-token
prediction. The weights are random: its text is meaningless by design.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.indexer import indexer
from ..kernels.sparse_mla_decode import sparse_mla_decode
from ..kernels.topk import topk
from .kv_pool import KVPool
from .tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    head_dim: int = 64
    rope_dim: int = 16
    window: int = 16
    ratio: int = 4
    topk: int = 8
    index_heads: int = 4
    index_dim: int = 32
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    seed: int = 0


@dataclass(frozen=True)
class Batch:
    """Query positions of one forward pass and where each request's KV lives.

    tokens [T]; positions [T] (absolute position of each token in its request); pages [T, max_pages]
    (the owning request's page table, -1 padded). Prefill passes chunks of one or more prompts, each
    a run of consecutive rows named in `segments` ((start, end) row ranges that share one page table);
    decode passes one new token for each running request (T = batch size, no segments).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor
    segments: tuple[tuple[int, int], ...] = ()


class TinyDSV4:
    def __init__(self, cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            std = scale if scale is not None else shape[0] ** -0.5
            return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype)

        c = cfg
        self.embed = w(c.vocab_size, c.d_model, scale=1.0)
        self.layers = [
            dict(
                wq=w(c.d_model, c.n_heads * c.head_dim),
                wkv=w(c.d_model, c.head_dim),
                wo=w(c.n_heads * c.head_dim, c.d_model),
                sink=w(c.n_heads, scale=1.0).float(),
                wc=w(c.head_dim, c.head_dim),
                wq_idx=w(c.d_model, c.index_heads * c.index_dim),
                w_idx=w(c.d_model, c.index_heads),
                wk_idx=w(c.head_dim, c.index_dim),
                w1=w(c.d_model, c.ffn_dim),
                w3=w(c.d_model, c.ffn_dim),
                w2=w(c.ffn_dim, c.d_model),
            )
            for _ in range(c.n_layers)
        ]
        self.lm_head = w(c.d_model, c.vocab_size)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rope_dim, 2, dtype=torch.float64) / c.rope_dim))
        self._inv_freq = inv.to(device)

    @torch.inference_mode()
    def forward(self, batch: Batch, pool: KVPool, last_only: torch.Tensor | None = None) -> torch.Tensor:
        """Write the batch's KV into `pool`, attend, and return logits [T, vocab] (or [len(last_only)])."""
        c = self.cfg
        x = self.embed[batch.tokens]
        rows = pool.token_rows(batch.pages, batch.positions)
        for li, p in enumerate(self.layers):
            h = _rms_norm(x)
            q = self._rope((h @ p["wq"]).view(-1, c.n_heads, c.head_dim), batch.positions)
            kv = self._rope((h @ p["wkv"]).view(-1, 1, c.head_dim), batch.positions).view(-1, c.head_dim)
            pool.main[li][rows] = kv
            self._compress(li, p, batch, pool)
            sel = self._select(li, p, h, batch, pool)
            out, _ = sparse_mla_decode(q, pool.main[li], self._window(batch, pool),
                                       extra_kv=pool.comp[li], extra_idx=sel, sink=p["sink"])
            x = x + out.reshape(-1, c.n_heads * c.head_dim) @ p["wo"]
            h = _rms_norm(x)
            x = x + (torch.nn.functional.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        if last_only is not None:
            x = x[last_only]
        return (_rms_norm(x) @ self.lm_head).float()

    def _rope(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        r = self.cfg.rope_dim
        ang = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(t.dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(t.dtype)[:, None, :]
        nope, rope = t[..., :-r], t[..., -r:]
        half = r // 2
        rotated = torch.cat([-rope[..., half:], rope[..., :half]], -1)
        return torch.cat([nope, rope * cos + rotated * sin], -1)

    def _window(self, batch: Batch, pool: KVPool) -> torch.Tensor:
        """[T, window] cache rows of the last `window` positions up to each query (-1 before 0)."""
        offs = torch.arange(self.cfg.window - 1, -1, -1, device=batch.positions.device)
        pos = batch.positions[:, None] - offs[None, :]
        rows = pool.token_rows(batch.pages, pos.clamp(min=0))
        return torch.where(pos >= 0, rows, -1).to(torch.int32)

    def _compress(self, li: int, p: dict, batch: Batch, pool: KVPool) -> None:
        """Fill the compressed entry of every group of `ratio` tokens that this batch completes."""
        ratio = self.cfg.ratio
        done = (batch.positions + 1) % ratio == 0
        if not bool(done.any()):
            return
        pos, pages = batch.positions[done], batch.pages[done]
        group_pos = pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)[None, :]
        src = pool.main[li][pool.token_rows(pages, group_pos)]            # [G, ratio, D]
        mean = src.mean(dim=1)
        entries = pool.entry_rows(pages, pos // ratio)
        pool.comp[li][entries] = mean @ p["wc"]
        pool.index_keys[li].view(-1, self.cfg.index_dim)[entries] = mean @ p["wk_idx"]

    def _select(self, li: int, p: dict, h: torch.Tensor, batch: Batch, pool: KVPool) -> torch.Tensor:
        """Indexer + top-k over each query's complete compressed entries -> [T, topk] rows (-1 pad)."""
        c = self.cfg
        live = ((batch.positions + 1) // c.ratio).to(torch.int32)
        q_idx = (h @ p["wq_idx"]).view(-1, c.index_heads, c.index_dim)
        weights = (h @ p["w_idx"]).float() * c.index_heads ** -0.5
        if batch.segments and not q_idx.is_cuda:
            chosen = torch.cat([_select_shared_table(q_idx[a:b], weights[a:b], pool.index_keys[li],
                                                     batch.pages[a], live[a:b], c.topk)
                                for a, b in batch.segments]).long()
        elif not q_idx.is_cuda:
            chosen = _select_rows(q_idx, weights, pool.index_keys[li], batch.pages, live, c.topk).long()
        else:
            scores = indexer(q_idx, weights, pool.index_keys[li], batch.pages.clamp(min=0).to(torch.int32), live)
            chosen = topk(scores, live, c.topk).long()
        rows = pool.entry_rows(batch.pages, chosen.clamp(min=0))
        return torch.where(chosen >= 0, rows, -1).to(torch.int32)


def _select_shared_table(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                         live: torch.Tensor, k: int) -> torch.Tensor:
    """`topk(indexer(...))` for rows of one request (one page table), on the CPU, as whole-tensor ops.

    The kernels' CPU reference loops over rows in Python, which made a forward cost O(rows)
    interpreter steps per layer; here all rows of a prompt chunk are scored at once. Same formula and
    rule: score[t, e] = sum_h relu(q[t,h] . key_e) * w[t,h] for e < live[t], the k best by (descending
    score, ascending index), -1 padded (tests/test_prefill_batching.py checks that the result equals
    the kernels' reference exactly).
    q [T, Hi, Di]; w [T, Hi]; keys [P, E, Di]; table [max_pages]; live [T] -> int32 [T, k].
    """
    n = int(live.max()) if live.numel() else 0
    if n == 0:
        return torch.full((q.shape[0], k), -1, dtype=torch.int32)
    per_page = keys.shape[1]
    kk = keys[table[: (n + per_page - 1) // per_page].long()].reshape(-1, keys.shape[-1])[:n].float()
    return _top(torch.relu(q.float() @ kk.T), w, live, k)


def _select_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
                 live: torch.Tensor, k: int) -> torch.Tensor:
    """`_select_shared_table` for rows with a page table each (a decode batch): tables [T, max_pages]."""
    n = int(live.max()) if live.numel() else 0
    if n == 0:
        return torch.full((q.shape[0], k), -1, dtype=torch.int32)
    per_page = keys.shape[1]
    pages = tables[:, : (n + per_page - 1) // per_page].clamp(min=0).long()
    kk = keys[pages].reshape(q.shape[0], -1, keys.shape[-1])[:, :n].float()          # [T, n, Di]
    return _top(torch.relu(q.float() @ kk.transpose(1, 2)), w, live, k)


def _top(logits: torch.Tensor, w: torch.Tensor, live: torch.Tensor, k: int) -> torch.Tensor:
    """relu'd logits [T, Hi, n] -> the k best live entries per row by the weighted head sum, -1 padded."""
    scores = (logits * w.float()[:, :, None]).sum(1)                                  # [T, n]
    n = scores.shape[1]
    scores = scores.masked_fill(torch.arange(n)[None, :] >= live[:, None], float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k].to(torch.int32)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    out[:, : order.shape[1]] = order.masked_fill(order >= live[:, None], -1)
    return out


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
