"""A tiny DeepSeek-V4-shaped model with seeded random weights: the embedded engine's compute.

What it shares with DeepSeek-V4: one shared KV head (MQA) whose value is its key (V = K), RoPE on the
last `rope_dim` dims, a sliding window of recent tokens, ratio-4 compressed entries of which an
indexer (`score = Σ_h relu(q_h·k)·w_h`) picks the top-k, and a per-head attention sink. Attention
goes through `kernel_ops.KernelOps` (reference ops on CPU; on CUDA our Triton/Gluon kernels for the
kernels asked for), so the engine is also the kernels' end-to-end test bed. Shapes come from a preset
(`presets.py`: `tiny` for the CPU, `flash` with DeepSeek-V4-Flash's attention shapes). What it leaves out:
MoE, hyper-connections, multi-token prediction, the ratio-128 layers, fp8 KV. The weights are random: its
text is meaningless by design.

A decode batch (`Batch.segments == ()`, one row per request) runs without a host sync when every kernel
is on, so `decode_graphs.py` can capture it in a CUDA graph; prefill chunks may sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernel_ops import KernelOps
from .kv_pool import KVPool
from .selection import select_rows, select_shared_table
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
    (the owning request's page table, int32 or int64; columns past the request's own pages are never read). Prefill passes chunks of one or more prompts, each
    a run of consecutive rows named in `segments` ((start, end) row ranges that share one page table);
    decode passes one new token for each running request (T = batch size, no segments).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor
    segments: tuple[tuple[int, int], ...] = ()


class TinyDSV4:
    def __init__(self, cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 kernels: tuple[str, ...] = ()):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.ops = KernelOps(device, kernels, cfg.n_heads, dtype)
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
            out = self.ops.sparse_decode(q, pool.main[li], self._window(batch, pool), pool.comp[li], sel, p["sink"])
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
        if not batch.segments:
            self._compress_rows(li, p, batch, pool, done)
            return
        if not bool(done.any()):
            return
        pos, pages = batch.positions[done], batch.pages[done]
        group_pos = pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)[None, :]
        src = pool.main[li][pool.token_rows(pages, group_pos)]            # [G, ratio, D]
        mean = src.mean(dim=1)
        entries = pool.entry_rows(pages, pos // ratio)
        pool.comp[li][entries] = mean @ p["wc"]
        pool.index_keys[li].view(-1, self.cfg.index_dim)[entries] = mean @ p["wk_idx"]

    def _compress_rows(self, li: int, p: dict, batch: Batch, pool: KVPool, done: torch.Tensor) -> None:
        """`_compress` for a decode batch without a host sync: every row computes its group's entry and
        writes it only where its token completes the group (elsewhere the entry's old value back). Rows are
        distinct requests, so no two rows write one entry (padding rows share the pad page: garbage there)."""
        ratio = self.cfg.ratio
        pos = batch.positions
        group_pos = (pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)[None, :]).clamp(min=0)
        mean = pool.main[li][pool.token_rows(batch.pages, group_pos)].mean(dim=1)
        entries = pool.entry_rows(batch.pages, pos // ratio)
        keys = pool.index_keys[li].view(-1, self.cfg.index_dim)
        keep = done[:, None]
        pool.comp[li][entries] = torch.where(keep, mean @ p["wc"], pool.comp[li][entries])
        keys[entries] = torch.where(keep, mean @ p["wk_idx"], keys[entries])

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
        rows = pool.entry_rows(batch.pages, chosen.clamp(min=0))
        return torch.where(chosen >= 0, rows, -1).to(torch.int32)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
