"""Indexer for DeepSeek-V4's CSA layers: score[t] = sum_h relu(q_h . k_t) * w_h over live entries.

`reference.py` (torch, shapes on `indexer_ref`), `triton_indexer.py` (the scores), `fused_topk.py` (the scores and
their top-k in one launch), `fp8_keys.py` (the fp8 key layout). The callers choose between kernel and reference:
the embedded engine (`workers/engine/kernel_ops.py`) and the SGLang adapter (`sglang_adapters/indexer.py`).
"""
