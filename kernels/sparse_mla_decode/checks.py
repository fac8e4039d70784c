"""Input checks shared by the reference and the Triton entry points of sparse MLA decode.

Shape and dtype checks only read tensor metadata, so they are safe inside CUDA-graph capture.
Index *values* are checked only where the caller asks (`check_index_values`): that needs a host
sync, which the CUDA path must never do.
"""

from __future__ import annotations

import torch


class SparseDecodeInputError(ValueError):
    """An argument of sparse MLA decode has the wrong shape, dtype, device or value."""


def check_queries(q: torch.Tensor) -> tuple[int, int, int]:
    if q.dim() != 3:
        raise SparseDecodeInputError(f"q must be [B, H, D], got shape {list(q.shape)}")
    if not q.is_floating_point():
        raise SparseDecodeInputError(f"q must be a float tensor, got {q.dtype}")
    b, h, d = q.shape
    return b, h, d


def check_indices(idx: torch.Tensor, b: int, name: str, device: torch.device) -> int:
    if idx.dim() != 2 or idx.shape[0] != b:
        raise SparseDecodeInputError(f"{name} must be [B={b}, n] int32, got shape {list(idx.shape)}")
    if idx.dtype != torch.int32:
        raise SparseDecodeInputError(f"{name} must be int32 (-1 = invalid), got {idx.dtype}; use .int()")
    if idx.device != device:
        raise SparseDecodeInputError(f"{name} is on {idx.device} but q is on {device}; move it with .to()")
    return idx.shape[1]


def check_lens(lens: torch.Tensor | None, b: int, name: str, device: torch.device) -> None:
    if lens is None:
        return
    if lens.dim() != 1 or lens.shape[0] != b or lens.dtype != torch.int32:
        raise SparseDecodeInputError(f"{name} must be [B={b}] int32, got {lens.dtype} {list(lens.shape)}")
    if lens.device != device:
        raise SparseDecodeInputError(f"{name} is on {lens.device} but q is on {device}; move it with .to()")


def check_rows(rows: torch.Tensor, d: int, name: str, device: torch.device) -> int:
    if rows.dim() != 2 or rows.shape[1] != d:
        raise SparseDecodeInputError(f"{name} must be [N, D={d}] (one KV head, V = K), got {list(rows.shape)}")
    if rows.device != device:
        raise SparseDecodeInputError(f"{name} is on {rows.device} but q is on {device}; move it with .to()")
    return rows.shape[0]


def check_extra_pair(extra: torch.Tensor | None, extra_idx: torch.Tensor | None) -> None:
    if (extra is None) != (extra_idx is None):
        raise SparseDecodeInputError(
            "extra cache and extra_idx go together: pass both (compressed entries) or neither (window only)"
        )


def check_sink(sink: torch.Tensor | None, h: int, device: torch.device) -> None:
    if sink is None:
        return
    if sink.shape != (h,) or sink.dtype != torch.float32:
        raise SparseDecodeInputError(f"sink must be [H={h}] float32, got {sink.dtype} {list(sink.shape)}")
    if sink.device != device:
        raise SparseDecodeInputError(f"sink is on {sink.device} but q is on {device}; move it with .to()")


def check_index_values(idx: torch.Tensor, num_rows: int, name: str) -> None:
    """Every index is -1 or a row of its cache (host sync: reference path only)."""
    if idx.numel() == 0:
        return
    bad = (idx < -1) | (idx >= num_rows)
    if bool(bad.any()):
        first = idx[bad][0].item()
        raise SparseDecodeInputError(
            f"{name} holds {first}, outside [-1, {num_rows}): an index is -1 (invalid) or a row of its cache"
        )
