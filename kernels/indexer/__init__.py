"""Indexer for DeepSeek-V4's CSA layers: score[t] = sum_h relu(q_h . k_t) * w_h over live entries.

`indexer` / `indexer_fp8` dispatch: Triton for CUDA tensors, the torch reference otherwise (the
embedded CPU engine). Shapes are documented on `reference.indexer_ref` and `triton_indexer`.
"""

from __future__ import annotations

import torch


def indexer(q, weights, k_cache, page_table, lens, **kernel_options) -> torch.Tensor:
    """Scores [B, max_pages*E] float32 of float keys [P, E, Di]; see `reference.indexer_ref`.

    On CUDA the tail past lens[b] is left unwritten (see `triton_indexer.indexer_triton`);
    kernel_options (out, split, block_t, num_warps) go to the Triton kernel only.
    """
    if q.is_cuda:
        from dsv4_cluster.kernels.indexer.triton_indexer import indexer_triton

        return indexer_triton(q, weights, k_cache, page_table, lens, **kernel_options)
    _refuse_kernel_options(kernel_options)
    from dsv4_cluster.kernels.indexer.reference import indexer_ref

    return indexer_ref(q, weights, k_cache, page_table, lens)


def indexer_fp8(q, weights, k_cache_fp8, page_table, lens, **kernel_options) -> torch.Tensor:
    """Scores of fp8 keys uint8 [P, E*(Di+4)] (layout in `fp8_keys`); see `reference.indexer_fp8_ref`."""
    if q.is_cuda:
        from dsv4_cluster.kernels.indexer.triton_indexer import indexer_fp8_triton

        return indexer_fp8_triton(q, weights, k_cache_fp8, page_table, lens, **kernel_options)
    _refuse_kernel_options(kernel_options)
    from dsv4_cluster.kernels.indexer.reference import indexer_fp8_ref

    return indexer_fp8_ref(q, weights, k_cache_fp8, page_table, lens)


def _refuse_kernel_options(kernel_options: dict) -> None:
    if kernel_options:
        raise TypeError(
            f"kernel options {sorted(kernel_options)} apply to the CUDA kernel only; "
            "the reference path (non-CUDA tensors) takes none"
        )


def indexer_topk(q, weights, k_cache, page_table, lens, k: int, *, fp8: bool = False, **kernel_options):
    """(idx int32 [B, k], scores float32 [B, max_pages*E]): the indexer's scores and their top-k.

    On CUDA one fused launch (`fused_topk.indexer_topk_triton`; idx order unspecified, kernel_options
    go there); otherwise `indexer_ref` / `indexer_fp8_ref` and `topk_ref` (idx sorted).
    """
    if q.is_cuda:
        from dsv4_cluster.kernels.indexer.fused_topk import indexer_topk_triton

        return indexer_topk_triton(q, weights, k_cache, page_table, lens, k, fp8=fp8, **kernel_options)
    _refuse_kernel_options(kernel_options)
    from dsv4_cluster.kernels.indexer.reference import indexer_fp8_ref, indexer_ref
    from dsv4_cluster.kernels.topk.reference import topk_ref

    scores = (indexer_fp8_ref if fp8 else indexer_ref)(q, weights, k_cache, page_table, lens)
    return topk_ref(scores, lens, k), scores
