"""KV capacity each server will have, predicted from the topology before anything starts.

Embedded engine: exact. Its pool holds `max_total_tokens // page_size` whole pages
(workers/runner.py `RunnerConfig.layout`), so `max_total_num_tokens` in its `/server_info` is that
times `page_size`; bytes per token follow from the pool layout (float32 rows: `main` per token,
`comp` per ratio-4 entry, the indexer keys per entry, in every layer).

SGLang: an explicit `max_total_tokens` is what the pool is cut to. Without it SGLang 0.5.23 sizes the
DeepSeek-V4 pool from the GPU memory left after loading weights (`DSV4PoolConfigurator`, with SWA
ratio, compress-state rings and request-slot bias); that prediction is NOT implemented here, and the
table says so instead of printing a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CAPACITY_TOLERANCE = 0.05  # `status` flags a server whose actual capacity misses the prediction by more

SGLANG_NOT_PREDICTED = ("not predicted: SGLang 0.5.23 sizes the DeepSeek-V4 pool from free GPU memory at "
                        "start (DSV4PoolConfigurator); set max_total_tokens to fix it, read /server_info after up")


@dataclass(frozen=True)
class Capacity:
    server: str
    engine: str
    max_total_num_tokens: int | None  # None: not predicted (see note)
    context_length: int
    kv_bytes_per_token: float | None
    note: str = ""

    @property
    def full_context_requests(self) -> int | None:
        if self.max_total_num_tokens is None:
            return None
        return self.max_total_num_tokens // self.context_length


def embedded_bytes_per_token(page_size: int) -> float:
    """Bytes of the embedded pool per token of capacity (float32, every layer, all three buffers)."""
    from dsv4_cluster.workers.model import ModelConfig

    m = ModelConfig()
    per_page = m.n_layers * 4 * (page_size * m.head_dim + (page_size // m.ratio) * (m.head_dim + m.index_dim))
    return per_page / page_size


def predict(topology: Any, worker: Any) -> Capacity:
    """The KV capacity `worker` of `topology` will report as `max_total_num_tokens`."""
    engine, context = str(topology.engine), topology.model.context_length
    if engine == "embedded":
        tokens = worker.max_total_tokens // worker.page_size * worker.page_size
        return Capacity(worker.name, engine, tokens, context, embedded_bytes_per_token(worker.page_size))
    if worker.max_total_tokens is not None:
        tokens = worker.max_total_tokens // worker.page_size * worker.page_size
        return Capacity(worker.name, engine, tokens, context, None, "cut to max_total_tokens (whole pages)")
    return Capacity(worker.name, engine, None, context, None, SGLANG_NOT_PREDICTED)


def capacity_table(rows: list[Capacity]) -> str:
    head = ("SERVER", "ENGINE", "MAX_TOTAL_NUM_TOKENS", "FULL_CONTEXT_REQS", "KV_BYTES/TOKEN", "NOTE")
    body = [(r.server, r.engine, "-" if r.max_total_num_tokens is None else str(r.max_total_num_tokens),
             "-" if r.full_context_requests is None else str(r.full_context_requests),
             "-" if r.kv_bytes_per_token is None else f"{r.kv_bytes_per_token:.0f}", r.note) for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body))
