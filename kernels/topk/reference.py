"""Reference top-k over each row's live prefix: the definition the radix-select kernel is tested against.

The rule, shared with the kernel: the k largest scores among scores[b, :lens[b]]; among equal
scores the lower index wins (-0.0 equals +0.0); rows with fewer than k live entries return all of
them and pad with -1. This reference returns the winners sorted by descending score, then
ascending index; the kernel returns the same set in an unspecified order.
"""

from __future__ import annotations

import torch


class TopkInputError(ValueError):
    """A top-k input has the wrong shape, dtype, device or value; the message says how to fix it."""


def check_topk_inputs(scores: torch.Tensor, lens: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise TopkInputError(f"scores must be a float tensor [B, N]; got {tuple(scores.shape)} {scores.dtype}")
    if tuple(lens.shape) != (scores.shape[0],) or lens.dtype not in (torch.int32, torch.int64):
        raise TopkInputError(f"lens must be int32 [B] with B = {scores.shape[0]}; got {tuple(lens.shape)} {lens.dtype}")
    if lens.device != scores.device:
        raise TopkInputError(f"lens is on {lens.device} but scores on {scores.device}; put both on one device")
    if not isinstance(k, int) or k < 1:
        raise TopkInputError(f"k must be a positive int; got {k!r}")


def check_lens_in_range(lens: torch.Tensor, width: int) -> None:
    """lens in [0, N]. Reads device memory (syncs), so callers skip it under CUDA-graph capture."""
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > width):
        raise TopkInputError(
            f"lens must lie in [0, N] = [0, {width}]; got values in [{int(lens.min())}, {int(lens.max())}]"
        )


def topk_ref(scores: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest live scores of each row, -1 padded.

    scores [B, N] any float dtype (NaN not allowed: its rank is undefined); lens [B] int32/int64 with
    0 <= lens[b] <= N; k >= 1 (any size, also > N). Entries at t >= lens[b] are never looked at.
    Returns int32 [B, k]: row b holds min(k, lens[b]) indices sorted by (descending score, ascending
    index), then -1.
    """
    check_topk_inputs(scores, lens, k)
    check_lens_in_range(lens, scores.shape[1])
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    for b in range(scores.shape[0]):
        n = int(lens[b])
        if n == 0:
            continue
        live = scores[b, :n].float()
        if torch.isnan(live).any():
            raise TopkInputError(f"scores row {b} holds NaN in its live prefix; its rank is undefined")
        order = torch.sort(live, descending=True, stable=True).indices[:k]
        out[b, : order.numel()] = order.to(torch.int32)
    return out
