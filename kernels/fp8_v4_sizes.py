"""The sizes of SGLang's DeepSeek-V4 fp8 KV-cache layout (`sparse_mla_decode/fp8_layout.py` describes it), without
torch: what a topology check or a capacity plan needs of it imports this alone (torch's import takes seconds).
"""

from __future__ import annotations

PAGE_TOKENS = 64
DIM = 512
NOPE_DIMS = 448
ROPE_DIMS = 64
TILE = 64
NUM_TILES = NOPE_DIMS // TILE  # 7
RECORD_BYTES = NOPE_DIMS + 2 * ROPE_DIMS  # 576
SCALE_BYTES = NUM_TILES + 1  # 8
BYTES_PER_TOKEN = RECORD_BYTES + SCALE_BYTES  # 584
SCALES_OFFSET = PAGE_TOKENS * RECORD_BYTES  # 36,864
PAGE_STRIDE = -(-PAGE_TOKENS * BYTES_PER_TOKEN // RECORD_BYTES) * RECORD_BYTES  # 37,440


def page_stride_for(page_tokens: int) -> int:
    """Bytes per page of `page_tokens` tokens: records and scales, padded to a multiple of 576 B."""
    return -(-page_tokens * BYTES_PER_TOKEN // RECORD_BYTES) * RECORD_BYTES
