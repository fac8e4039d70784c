"""What prefill and decode must agree on before KV pages can move between them (`PoolLayout`), and its bytes per
page for float rows and for SGLang's DeepSeek-V4 fp8 layout (`fp8.py` holds the fp8 buffers themselves). No torch:
a topology check and a capacity plan import this alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.fp8_v4_sizes import DIM, page_stride_for

FP8 = "fp8_e4m3"
KEY_SCALE_BYTES = 4
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}   # a float row's element, by `PoolLayout.dtype`


def fp8_layout_problems(page_size: int, head_dim: int, index_dim: int) -> list[str]:
    out = []
    if head_dim != DIM:
        out.append(f"the fp8 KV layout holds {DIM}-dim rows (448 e4m3 + 64 bf16 RoPE dims), this model's are "
                   f"{head_dim}: use --kv-cache-dtype auto, or the flash preset")
    if page_size < 1 or page_size & (page_size - 1):
        out.append(f"the fp8 KV layout's pages hold a power of two of tokens (SGLang: 256); got page_size {page_size}")
    if index_dim % 4:
        out.append(f"fp8 index keys need index_dim % 4 == 0; got {index_dim}")
    return out


def fp8_page_bytes(page_size: int, ratios: tuple[int, ...], indexed_ratio: int, index_dim: int) -> int:
    """Bytes of one pool page over every layer's buffers (padding included)."""
    total = 0
    for r in ratios:
        e = page_size // r
        total += rows_page_bytes(page_size) + rows_page_bytes(e)
        if r == indexed_ratio:
            total += keys_page_bytes(e, index_dim)
    return total


def rows_page_bytes(rows_per_page: int) -> int:
    """Bytes of one page of a rows buffer (records, scale rows, padding to a multiple of 576 B)."""
    return page_stride_for(rows_per_page)


def keys_page_bytes(entries: int, index_dim: int) -> int:
    """Bytes of one page of an index-keys buffer (e4m3 keys, then one fp32 scale per key)."""
    return entries * (index_dim + KEY_SCALE_BYTES)


class PoolLayoutError(ValueError):
    """A pool layout that cannot hold this model's KV (the message says which flag to change)."""


@dataclass(frozen=True)
class PoolLayout:
    """What prefill and decode must agree on before KV pages can move between them."""

    page_size: int
    num_pages: int
    n_layers: int
    head_dim: int
    index_dim: int
    ratio: int                           # the indexed (top-k) layers' compression ratio
    dtype: str                           # float32 | bfloat16 | fp8_e4m3
    layer_ratios: tuple[int, ...] = ()   # each layer's ratio (() = every layer `ratio`)

    def __post_init__(self):
        object.__setattr__(self, "layer_ratios", tuple(self.layer_ratios))   # a list after a JSON round trip

    @property
    def ratios(self) -> tuple[int, ...]:
        return self.layer_ratios or (self.ratio,) * self.n_layers

    @property
    def entries_per_page(self) -> int:
        return self.page_size // self.ratio

    def indexed(self, layer: int) -> bool:
        """Whether the layer picks its entries by indexer + top-k (else it attends to every entry)."""
        return self.ratios[layer] == self.ratio

    def compatible(self, other: "PoolLayout") -> list[str]:
        """Names of the fields (all but capacity) on which two pools disagree."""
        keys = ("page_size", "n_layers", "head_dim", "index_dim", "ratios", "dtype")
        return [k for k in keys if getattr(self, k) != getattr(other, k)]

    def problems(self) -> list[str]:
        out = []
        for r in sorted(set(self.ratios)):
            if self.page_size % r:
                hint = "; SGLang runs DeepSeek-V4 with 256-token pages" if r > self.ratio else ""
                out.append(f"page_size {self.page_size} must be a multiple of the compression ratio {r} of layer "
                           f"{self.ratios.index(r)}{hint}")
        if len(self.ratios) != self.n_layers:
            out.append(f"{len(self.ratios)} layer ratios for {self.n_layers} layers")
        if self.dtype == FP8:
            out += fp8_layout_problems(self.page_size, self.head_dim, self.index_dim)
        return out

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across every buffer (`KVPool.page_bytes` measures the same on the tensors)."""
        if self.dtype == FP8:
            return fp8_page_bytes(self.page_size, self.ratios, self.ratio, self.index_dim)
        element_size = ELEMENT_BYTES[self.dtype]
        total = 0
        for li, r in enumerate(self.ratios):
            e = self.page_size // r
            keys = e * self.index_dim if self.indexed(li) else 0
            total += self.page_size * self.head_dim + e * self.head_dim + keys
        return total * element_size
