"""Top-k over each row's live prefix (DeepSeek-V4 CSA: the top-512 compressed entries per query).

`reference.topk_ref` (the rule; sorted by descending score, then index) and `radix_select.topk_triton` (the Triton
radix select: the same set, in an unspecified order). The callers choose between them
(`workers/engine/kernel_ops.py`, `sglang_adapters/topk.py`).
"""
