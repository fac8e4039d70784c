"""Top-k over each row's live prefix (DeepSeek-V4 CSA: the top-512 compressed entries per query).

`topk` dispatches: the Triton radix select for CUDA tensors, the torch reference otherwise (the
embedded CPU engine). Both return the same set; see `reference.topk_ref` for the rule.
"""

from __future__ import annotations

import torch


def topk(scores: torch.Tensor, lens: torch.Tensor, k: int, **kernel_options) -> torch.Tensor:
    """int32 [B, k] indices of the k largest of scores[b, :lens[b]], -1 padded.

    On CUDA the winners come in an unspecified order (see `radix_select.topk_triton`; kernel_options
    out, workspace, split, block, num_warps go there); on CPU sorted by descending score, then index.
    """
    if scores.is_cuda:
        from dsv4_cluster.kernels.topk.radix_select import topk_triton

        return topk_triton(scores, lens, k, **kernel_options)
    if kernel_options:
        raise TypeError(
            f"kernel options {sorted(kernel_options)} apply to the CUDA kernel only; "
            "the reference path (non-CUDA tensors) takes none"
        )
    from dsv4_cluster.kernels.topk.reference import topk_ref

    return topk_ref(scores, lens, k)
