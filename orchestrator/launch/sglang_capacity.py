"""The KV pool SGLang 0.5.23 gives DeepSeek-V4 on one GPU: `max_total_num_tokens`, computed its way.

Pinned to 0.5.23 (`SIZING_VERSION`; another version is refused). The derivation, step by step with SGLang's
function names, is in docs/sglang.md; tests/sglang/test_sglang_capacity.py checks it against SGLang's own classes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_cluster.core import Role

SIZING_VERSION = "0.5.23"
GIB = 1 << 30
CUDA_CONTEXT_GIB = 1.21  # nvidia-smi total minus free after CUDA init, measured on an H200 (GpuInputs)

# SGLang 0.5.23 facts for DeepSeek-V4 (file names relative to sglang/srt in the wheel):
DSV4_MAX_RUNNING_REQUESTS = 256  # arg_groups/deepseek_v4_hook.py: set when --max-running-requests is unset
DSV4_SWA_FULL_TOKENS_RATIO = 0.1  # arg_groups/model_overrides/deepseek_v4.py
V4_ROW_BYTES = 584  # KVLayout.V4: 576 data (448 e4m3 + 64 bf16 rope) + 8 scale bytes
V4_PAGE_ALIGN = 576  # KVLayout.V4.page_align: the page stride is padded to a multiple of it
C4_RING, C128_RING = 8, 128  # deepseek_v4_memory_pool.get_compress_state_ring_size, no speculative decoding
STATE_DTYPE_BYTES = 4  # SGLANG_DSV4_COMPRESS_STATE_DTYPE defaults to float32
# Extra flags that change SGLang's sizing in ways this module does not follow: refused, not guessed.
UNMODELLED_FLAGS = ("--max-running-requests", "--swa-full-tokens-ratio", "--speculative-algorithm",
                    "--enable-hisparse", "--disaggregation-decode-extra-slots", "--chunked-prefill-size",
                    "--cuda-graph-max-bs", "--disable-cuda-graph", "--pp-size", "--dp-size",
                    "--enable-dp-attention", "--kv-cache-dtype", "--page-size", "--enable-unified-memory",
                    "--max-prefill-tokens", "--dsv4-attn-backend", "--enable-kv-cache-sharding")


class SizingError(ValueError):
    """SGLang's DeepSeek-V4 pool size cannot be computed for these inputs (says why)."""


@dataclass(frozen=True)
class DSV4Geometry:
    """What the pool sizing reads from DeepSeek-V4's config.json (main model layers only)."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    sliding_window: int
    compress_ratios: tuple[int, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DSV4Geometry:
        if "DeepseekV4ForCausalLM" not in config.get("architectures", []):
            raise SizingError(f"config.json architectures {config.get('architectures')} is not DeepSeek-V4")
        rope = int(config["qk_rope_head_dim"])
        layers = int(config["num_hidden_layers"])
        return cls(int(config["head_dim"]) - rope, rope, int(config["index_head_dim"]),
                   int(config["sliding_window"]), tuple(int(r) for r in config["compress_ratios"][:layers]))

    def layers(self, ratio: int) -> int:
        return sum(1 for r in self.compress_ratios if r == ratio)

    @property
    def attn_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# DeepSeek-V4-Flash's public config.json (tests/data/deepseek-v4-flash, checked equal in the tests):
# head_dim 512 of which 64 RoPE, indexer 128 dims, window 128, 43 layers: 2 window-only, 21 C4, 20 C128.
DSV4_FLASH = DSV4Geometry(448, 64, 128, 128, (0, 0) + (4, 128) * 20 + (4,))


def checkpoint_config(model_path: str) -> dict | None:
    """A local checkpoint folder's config.json (None: no such file, e.g. a hub name); ValueError if it is not JSON."""
    config = Path(str(model_path)) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def geometry_for(model_path: str) -> DSV4Geometry:
    """The geometry of a local checkpoint folder's config.json, else DeepSeek-V4-Flash's."""
    config = checkpoint_config(model_path)
    return DSV4Geometry.from_config(config) if config is not None else DSV4_FLASH


@dataclass(frozen=True)
class GpuInputs:
    """The numbers SGLang measures at start, per GPU; defaults: DeepSeek-V4-Flash on an H200, each explained in
    docs/sglang.md (`total_mib` nvidia-smi's total, `free_before_load_gib` SGLang's pre-load free memory,
    `checkpoint_gib` the checkpoint split evenly over TP)."""

    total_mib: float = 143771.0
    free_before_load_gib: float | None = None
    checkpoint_gib: float = 149.0

    def pre_gib(self) -> float:
        if self.free_before_load_gib is not None:
            return self.free_before_load_gib
        return self.total_mib / 1024 - CUDA_CONTEXT_GIB

    def weights_gib(self, tp: int) -> float:
        return self.checkpoint_gib / tp


@dataclass(frozen=True)
class PoolSize:
    """One server's DeepSeek-V4 KV pool at one memory fraction."""

    mem_fraction_static: float
    available_bytes: int
    bytes_per_full_token: float
    bytes_per_swa_token: float
    fixed_bytes: int
    max_total_num_tokens: int
    swa_tokens: int
    max_running_requests: int
    pool_bytes: int  # what the pool takes, as SGLang's sizing accounts it
    free_after_pool_bytes: int  # left on the GPU for activations and CUDA graphs


def _page_bytes_per_token(tokens_per_page: int) -> float:
    raw = tokens_per_page * V4_ROW_BYTES
    return math.ceil(raw / V4_PAGE_ALIGN) * V4_PAGE_ALIGN / tokens_per_page


def indexer_bytes_per_token(g: DSV4Geometry) -> int:
    """fp8 indexer keys: the dims plus a 4-byte scale per 128 (get_dsv4_indexer_bytes_per_token)."""
    return g.index_head_dim + g.index_head_dim // 128 * 4


def bytes_per_swa_token(g: DSV4Geometry, page_size: int) -> float:
    """`DSV4PoolConfigurator._get_bytes_per_swa_token`: window KV of every layer + the C4 state ring."""
    c4_state = 2 * 2 * g.attn_head_dim * STATE_DTYPE_BYTES
    c4_indexer_state = 2 * 2 * g.index_head_dim * STATE_DTYPE_BYTES
    return (_page_bytes_per_token(page_size) * len(g.compress_ratios)
            + C4_RING / page_size * (c4_state + c4_indexer_state) * g.layers(4))


def bytes_per_full_token(g: DSV4Geometry, page_size: int) -> float:
    """`DSV4PoolConfigurator._get_bytes_per_full_token` (ratio mode: SWA slots are 10% of full tokens)."""
    c4 = _page_bytes_per_token(page_size // 4) / 4 + indexer_bytes_per_token(g) / 4
    c128 = _page_bytes_per_token(page_size // 128) / 128
    return (DSV4_SWA_FULL_TOKENS_RATIO * bytes_per_swa_token(g, page_size)
            + c4 * g.layers(4) + c128 * g.layers(128))


def c128_state_bytes(g: DSV4Geometry, request_slots: int) -> int:
    """`_get_c128_state_fixed_bytes`: a 128-row ring per request slot, rows padded to 128."""
    rows = math.ceil((request_slots * C128_RING + C128_RING + 1) / 128) * 128
    return rows * 2 * g.attn_head_dim * STATE_DTYPE_BYTES * g.layers(128)


def default_mem_fraction(total_mib: float, role: Role, tp: int) -> float:
    """SGLang's default `--mem-fraction-static` for a DeepSeek-V4 PD server (memory_hook.py): GPU memory
    minus a reserve for activations and CUDA graphs (prefill servers capture none, decode servers do).
    The decode activation estimate uses the graph batch size: `max_running_requests` is still unset when
    the heuristic runs (the DeepSeek-V4 hook sets 256 after it)."""
    if total_mib < 20 * 1024 or total_mib >= 160 * 1024:
        raise SizingError(f"{total_mib:.0f} MiB GPUs: only the 20-160 GiB brackets of SGLang's heuristic "
                          "are followed here; pass --mem-fraction-static in extra_args")
    if total_mib < 35 * 1024:
        chunked_prefill, decode_max_bs = 4096, (48 if tp < 4 else 160)
    elif total_mib < 60 * 1024:
        chunked_prefill, decode_max_bs = 4096, (32 if tp < 4 else 160)
    else:
        chunked_prefill, decode_max_bs = 8192, (256 if tp < 4 else 512)
    if role == Role.DECODE:
        reserved = 512 + max(decode_max_bs, 2048) * 1.5 + tp / 8 * 1024 + decode_max_bs * 2
    else:
        reserved = 512 + max(chunked_prefill, 2048) * 1.5 + tp / 8 * 1024
    if total_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((total_mib - reserved) / total_mib, 3)


def available_bytes(pre_gib: float, weights_gib: float, mem_fraction: float) -> int:
    """`_profile_available_bytes`: free after loading minus the non-static slack, in bytes."""
    rest = (pre_gib - weights_gib) - pre_gib * (1 - mem_fraction)
    if rest <= 0:
        need = 1 - (pre_gib - weights_gib) / pre_gib
        raise SizingError(f"mem_fraction_static {mem_fraction} leaves no memory for the KV cache after "
                          f"{weights_gib:.1f} GiB of weights per GPU; it must exceed {need:.3f}")
    return int(rest * GIB)


def size_pool(g: DSV4Geometry, *, available: int, mem_fraction: float,
              max_total_tokens: int | None = None, page_size: int = 256, sglang_version: str = SIZING_VERSION,
              pre_gib: float = 0.0, weights_gib: float = 0.0) -> PoolSize:
    """What SGLang `sglang_version` allocates from `available` bytes; raises SizingError."""
    if sglang_version != SIZING_VERSION:
        raise SizingError(f"the DeepSeek-V4 pool sizing here is SGLang {SIZING_VERSION}'s; SGLang "
                          f"{sglang_version} sizes it differently — not predicted")
    per_full, per_swa = bytes_per_full_token(g, page_size), bytes_per_swa_token(g, page_size)
    slots = DSV4_MAX_RUNNING_REQUESTS + 1  # a decode server adds disaggregation_decode_extra_slots: 0 by default
    fixed = c128_state_bytes(g, slots)
    full = int(max(available - fixed, 0) / per_full) // page_size * page_size
    # Reserved low-ratio (1, 2) pages would be removed here; DeepSeek-V4(-Flash) has none.
    if g.layers(1) or g.layers(2):
        raise SizingError("ratio-1/2 compressed layers (DeepSeek-V4.1) are not followed here")
    if max_total_tokens is not None:
        full = min(full, max_total_tokens) // page_size * page_size
    if full <= 0:
        raise SizingError(f"no room for a KV page: {available / GIB:.2f} GiB available, "
                          f"{fixed / GIB:.2f} GiB of it the C128 compress state")
    swa = int(full * DSV4_SWA_FULL_TOKENS_RATIO) // page_size * page_size
    if g.sliding_window + page_size >= swa:
        raise SizingError(f"SWA pool of {swa} tokens cannot hold one request; raise the memory fraction")
    pool = int(full * per_full + fixed)
    free_after = int(pre_gib * GIB - weights_gib * GIB - pool)
    return PoolSize(mem_fraction, available, per_full, per_swa, fixed, full, swa,
                    min(DSV4_MAX_RUNNING_REQUESTS, full // 2), pool, free_after)


def sizing_flags(extra_args: list[str]) -> tuple[float | None, list[str]]:
    """(`--mem-fraction-static` from extra args or None, the unmodelled sizing flags among them)."""
    fraction, unmodelled = None, []
    for i, a in enumerate(extra_args):
        name = a.split("=", 1)[0]
        if name == "--mem-fraction-static":
            value = a.split("=", 1)[1] if "=" in a else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            try:
                fraction = float(value)
            except ValueError:
                raise SizingError(f"--mem-fraction-static {value!r} is not a number") from None
        elif name in UNMODELLED_FLAGS:
            unmodelled.append(name)
    return fraction, unmodelled


def installed_sglang_version() -> str:
    """The SGLang installed here, else the pinned one (the version `up` requires and preflight checks)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return SIZING_VERSION
