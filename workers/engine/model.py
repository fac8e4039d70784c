"""A tiny DeepSeek-V4-shaped model with seeded random weights: the embedded engine's compute.

Shared with DeepSeek-V4: one KV head (MQA, V = K), RoPE on the last `rope_dim` dims, a sliding window, compressed
entries at each layer's ratio (`compress_ratios`), a per-head attention sink. Ratio-4 layers add the top-k of their
entries picked by an indexer (`score = Σ_h relu(q_h·k)·w_h`); ratio-128 layers add every complete entry. An entry
is the mean of its tokens' rows times a projection (V4 learns its compressor). Left out: MoE, hyper-connections,
MTP, the window-only layers. The weights are random: its text is meaningless by design. A decode batch runs
without a host sync when every kernel is on, so `decode_graphs.py` can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv import fp8 as kv_fp8
from ..kv.pool import KVPool
from .config import DENSE_RATIO, ModelConfig  # noqa: F401
from .kernel_ops import KernelOps
from .selection import select_rows, select_shared_table


@dataclass(frozen=True)
class Batch:
    """Query positions of one forward pass and where each request's KV lives.

    tokens [T]; positions [T] (absolute position of each token in its request); pages [T, max_pages]
    (the owning request's page table, int32 or int64; columns past the request's own pages are never read). Prefill passes chunks of one or more prompts, each
    a run of consecutive rows named in `segments` ((start, end) row ranges that share one page table);
    decode passes one new token for each running request (T = batch size, no segments). `dense_entries`
    [T, n] int32: rows of each request's ratio-128 entries 0..n-1, given by a caller whose page tables are wider
    than the live pages (CUDA graphs fill it within the live width); None: built from `pages`.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor
    segments: tuple[tuple[int, int], ...] = ()
    dense_entries: torch.Tensor | None = None


class TinyDSV4:
    def __init__(self, cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 kernels: tuple[str, ...] = ()):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.ops = KernelOps(device, kernels, cfg.n_heads, dtype, nominal_rows=cfg.window + cfg.topk)
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            std = scale if scale is not None else shape[0] ** -0.5
            # scaled in place: the flash preset's 1.2 GB of float32 weights took a second more allocated twice
            return torch.randn(*shape, generator=gen).mul_(std).to(device=device, dtype=dtype)

        c = cfg
        self.embed = w(c.vocab_size, c.d_model, scale=1.0)
        self.layers = []
        for r in c.layer_ratios:
            layer = dict(wq=w(c.d_model, c.n_heads * c.head_dim), wkv=w(c.d_model, c.head_dim),
                         wo=w(c.n_heads * c.head_dim, c.d_model), sink=w(c.n_heads, scale=1.0).float(),
                         wc=w(c.head_dim, c.head_dim))
            if r == c.ratio:   # the indexer's weights (ratio-128 layers have none)
                layer.update(wq_idx=w(c.d_model, c.index_heads * c.index_dim), w_idx=w(c.d_model, c.index_heads),
                             wk_idx=w(c.head_dim, c.index_dim))
            layer.update(w1=w(c.d_model, c.ffn_dim), w3=w(c.d_model, c.ffn_dim), w2=w(c.ffn_dim, c.d_model))
            self.layers.append(layer)
        self.lm_head = w(c.d_model, c.vocab_size)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rope_dim, 2, dtype=torch.float64) / c.rope_dim))
        self._inv_freq = inv.to(device)

    @torch.inference_mode()
    def forward(self, batch: Batch, pool: KVPool, last_only: torch.Tensor | None = None) -> torch.Tensor:
        """Write the batch's KV into `pool`, attend, and return logits [T, vocab] (or [len(last_only)])."""
        c = self.cfg
        x = self.embed[batch.tokens]
        rows = pool.token_rows(batch.pages, batch.positions)
        window = self._window(batch, pool)
        for li, p in enumerate(self.layers):
            h = _rms_norm(x)
            q = self._rope((h @ p["wq"]).view(-1, c.n_heads, c.head_dim), batch.positions)
            kv = self._rope((h @ p["wkv"]).view(-1, 1, c.head_dim), batch.positions).view(-1, c.head_dim)
            pool.write_main(li, rows, kv)
            self._compress(li, p, batch, pool)
            if pool.layout.indexed(li):
                sel = self._select(li, p, h, batch, pool)
                out = self.ops.sparse_decode(q, pool.main[li], window, pool.comp[li], sel, p["sink"],
                                             geometry=_geometry(pool, li))
            else:
                out = self._attend_dense(li, q, window, batch, pool, p["sink"])
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
        """Fill the compressed entry of every group of the layer's ratio of tokens that this batch completes."""
        ratio = pool.layout.ratios[li]
        done = (batch.positions + 1) % ratio == 0
        if not batch.segments:
            self._compress_rows(li, p, batch, pool, done)
            return
        if not bool(done.any()):
            return
        pos, pages = batch.positions[done], batch.pages[done]
        group_pos = pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)[None, :]
        mean = pool.read_main(li, pool.token_rows(pages, group_pos)).mean(dim=1)      # [G, D]
        entries = pool.entry_rows(pages, pos // ratio, li)
        pool.write_comp(li, entries, mean @ p["wc"])
        if "wk_idx" in p:
            pool.write_keys(li, entries, mean @ p["wk_idx"])

    def _compress_rows(self, li: int, p: dict, batch: Batch, pool: KVPool, done: torch.Tensor) -> None:
        """`_compress` for a decode batch without a host sync: every row computes its group's entry and
        writes it only where its token completes the group (elsewhere the entry's old value back). Rows are
        distinct requests, so no two rows write one entry (padding rows share the pad page: garbage there).
        Reads `ratio` main rows per row: O(ratio), whatever the context."""
        ratio = pool.layout.ratios[li]
        pos = batch.positions
        group_pos = (pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)[None, :]).clamp(min=0)
        mean = pool.read_main(li, pool.token_rows(batch.pages, group_pos)).mean(dim=1)
        entries = pool.entry_rows(batch.pages, pos // ratio, li)
        pool.write_comp(li, entries, mean @ p["wc"], keep=done)
        if "wk_idx" in p:
            pool.write_keys(li, entries, mean @ p["wk_idx"], keep=done)

    def _attend_dense(self, li: int, q: torch.Tensor, window: torch.Tensor, batch: Batch, pool: KVPool,
                      sink: torch.Tensor) -> torch.Tensor:
        """A ratio-128 layer: window + entries 0 .. (pos + 1) // 128 - 1 of each query's request, all of them,
        as the extra rows of the sparse decode op with extra_lens = that count (the op reads no index past it,
        so its work follows the live length, not the index list's width)."""
        ratio, geo = pool.layout.ratios[li], _geometry(pool, li)
        live = ((batch.positions + 1) // ratio).to(torch.int32)
        main, comp = pool.main[li], pool.comp[li]
        if batch.segments:   # prefill: one call per chunk, its rows sharing one list of its request's entries
            outs = []
            for a, b in batch.segments:
                n = max(int(live[b - 1]), 1)      # positions rise within a chunk: its last row sees the most
                idx = entry_table(batch.pages[a:a + 1], pool.entries_per_page(li))[:, :n].expand(b - a, n)
                outs.append(self.ops.sparse_decode(q[a:b], main, window[a:b], comp, idx, sink, geometry=geo,
                                                   extra_lens=live[a:b], dense=True))
            return torch.cat(outs)
        idx = batch.dense_entries
        if idx is None:
            idx = entry_table(batch.pages, pool.entries_per_page(li))
        return self.ops.sparse_decode(q, main, window, comp, idx, sink, geometry=geo, extra_lens=live, dense=True)

    def _select(self, li: int, p: dict, h: torch.Tensor, batch: Batch, pool: KVPool) -> torch.Tensor:
        """Indexer + top-k over each query's complete compressed entries -> [T, topk] rows (-1 pad)."""
        c = self.cfg
        live = ((batch.positions + 1) // c.ratio).to(torch.int32)
        q_idx = (h @ p["wq_idx"]).view(-1, c.index_heads, c.index_dim)
        weights = (h @ p["w_idx"]).float() * c.index_heads ** -0.5
        ops = self.ops
        if batch.segments:
            ops.count_reference("indexer", "topk")
            chosen = torch.cat([select_shared_table(q_idx[a:b], weights[a:b], pool.index_keys[li],
                                                    batch.pages[a], live[a:b], c.topk)
                                for a, b in batch.segments]).long()
        elif ops.kernel["indexer"] and ops.kernel["topk"]:
            scores = ops.indexer(q_idx, weights, pool.index_keys[li], batch.pages, live)
            chosen = ops.topk(scores, live, c.topk).long()
        else:
            ops.count_reference("indexer", "topk")
            chosen = select_rows(q_idx, weights, pool.index_keys[li], batch.pages, live, c.topk).long()
        rows = pool.entry_rows(batch.pages, chosen.clamp(min=0), li)
        return torch.where(chosen >= 0, rows, -1).to(torch.int32)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def entry_table(pages: torch.Tensor, per_page: int) -> torch.Tensor:
    """int32 [T, P * per_page]: the rows of compressed entries 0 .. P * per_page - 1 of page tables [T, P]."""
    offs = torch.arange(per_page, device=pages.device)
    return (pages.long()[:, :, None] * per_page + offs).reshape(pages.shape[0], -1).to(torch.int32)


def _geometry(pool: KVPool, li: int):
    """(main, comp) page geometries of an fp8 pool's layer (the slot numbering the kernels read), else None."""
    if not pool.fp8:
        return None
    return (kv_fp8.geometry(pool.main[li], pool.layout.page_size),
            kv_fp8.geometry(pool.comp[li], pool.entries_per_page(li)))
