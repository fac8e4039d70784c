"""Scratch buffers of the kernels' host side, cached so an eager call allocates nothing.

Why a cache: SGLang runs prefill, mixed batches and batch sizes above its captured set eagerly, and
there every torch.empty / torch.zeros of a workspace costs host time on each layer. A buffer is kept
per (device, stream, name, dtype) and grown to the largest size asked for; calls on one stream run in
order, so reusing it is safe. Under CUDA-graph capture a fresh buffer is returned and not kept: it
belongs to the graph's memory pool, and the graph's replays must not share it with eager calls.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of `numel` elements (contents undefined) for `name` on the current stream of `device`."""
    if device.type != "cuda":
        return torch.empty(numel, dtype=dtype, device=device)
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(numel, dtype=dtype, device=device)
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream, name, dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf[:numel]
