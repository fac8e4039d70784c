"""The `flash` preset (DeepSeek-V4-Flash's attention shapes) on the CPU reference ops, and the kernel call counters.

CI has no GPU: these run the flash shapes (64 heads x 512, window 128, top-512, indexer 64 x 128) through the
same model code the CUDA engine runs, with 1-2 layers and a short prompt so that they stay quick.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.workers.engine.kernel_ops import KernelOps
from dsv4_cluster.workers.engine.presets import PRESETS, PresetError, kv_bytes_per_token, model_config
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _runner(context_length: int = 512, layers: int = 1, preset: str = "flash") -> ModelRunner:
    cfg = model_config(preset, seed=3, n_layers=layers) if preset == "flash" else model_config(preset, seed=3)
    return ModelRunner(RunnerConfig(model=cfg, page_size=16, max_total_tokens=max(1024, context_length),
                                    context_length=context_length))


def test_flash_preset_has_deepseek_v4_flash_attention_shapes():
    c = PRESETS["flash"]
    assert (c.n_heads, c.head_dim, c.rope_dim, c.head_dim - c.rope_dim) == (64, 512, 64, 448)
    assert (c.window, c.ratio, c.topk, c.index_heads, c.index_dim) == (128, 4, 512, 64, 128)
    assert c.layer_ratios == (4, 128, 4, 128)        # V4-Flash's alternation (its config's compress_ratios[2:42])
    # fp8 KV of 4 layers at SGLang's 256-token pages: per ratio-4 layer a 149,760-B token page, a 37,440-B page
    # of 64 entries and 64 index keys of 132 B; per ratio-128 layer the token page and a 1,728-B page of 2 entries
    assert kv_bytes_per_token(c, "fp8_e4m3", 256) == 2 * (149760 + 37440 + 64 * 132 + 149760 + 1728) / 256 == 2712
    # 1M tokens of configured context fit in a few GB of an H200's 141 GB (bf16 rows too)
    assert kv_bytes_per_token(c, "bfloat16", 256) * 1024**2 < 8 * 1024**3
    with pytest.raises(PresetError, match="choose from tiny, flash"):
        model_config("huge")


@pytest.fixture(scope="module")
def flash():
    return _runner(layers=1)


def test_flash_preset_generates_on_the_cpu_reference_ops(flash):
    prompt = [(7 * i) % 250 for i in range(140)]      # longer than the window of 128
    before = flash.model.ops.counts()
    out = generate_single_process(flash, prompt, GREEDY, EOS)
    assert len(out) == 4 and all(0 <= t < flash.cfg.model.vocab_size for t in out)
    calls = flash.model.ops.counts()
    # 1 layer x (1 prefill forward + 3 decode steps), all on the reference ops
    assert all(calls[k]["reference"] - before[k].get("reference", 0) == 4 for k in calls), (before, calls)


def test_flash_decode_batch_equals_each_request_alone(flash):
    """Two requests of different lengths decoded in one batch give each its single-request logits."""
    a, b = [(3 * i) % 200 for i in range(137)], [(5 * i) % 200 for i in range(61)]
    pool = flash.pool
    pa, pb = pool.alloc(160), pool.alloc(80)
    try:
        la, lb = flash.prefill(a, pa), flash.prefill(b, pb)
        ta, tb = int(la.argmax()), int(lb.argmax())
        batched = flash.decode([ta, tb], [len(a), len(b)], [pa, pb])
        alone_a = flash.decode([ta], [len(a)], [pa])[0]
        alone_b = flash.decode([tb], [len(b)], [pb])[0]
    finally:
        pool.release(pa)
        pool.release(pb)
    assert torch.allclose(batched[0], alone_a, atol=1e-4) and torch.allclose(batched[1], alone_b, atol=1e-4)
    assert torch.isfinite(batched).all()


def test_configured_context_does_not_change_the_tokens():
    """Page tables are as wide as the batch's own pages: a 64K-token configured context decodes as 1K does."""
    prompt = list(range(40, 140))
    short, long = _runner(1024, preset="tiny"), _runner(65536, preset="tiny")
    assert generate_single_process(short, prompt, GREEDY, EOS) == generate_single_process(long, prompt, GREEDY, EOS)


def test_kernel_summary_says_what_ran_not_what_was_asked():
    requested = ("sparse_mla_decode", "indexer")
    counts = {"sparse_mla_decode": {"gluon": 40, "reference": 2}, "indexer": {}, "topk": {"reference": 9}}
    assert KernelOps.summary(counts, requested) == {
        "sparse_mla_decode": "gluon+reference", "indexer": "not called yet", "topk": "off"}
    assert KernelOps.summary({"topk": {"triton": 1}}, ())["topk"] == "triton"


def test_cpu_ops_count_reference_calls_even_when_kernels_are_asked_for():
    ops = KernelOps("cpu", ("sparse_mla_decode", "indexer", "topk"), 64, torch.float32)
    assert not ops.all_kernels and ops.impl == {"sparse_mla_decode": "reference", "indexer": "reference",
                                                "topk": "reference"}
    ops.count_reference("indexer")
    assert ops.counts() == {"sparse_mla_decode": {}, "indexer": {"reference": 1}, "topk": {}}


def test_capture_sizes_and_padded_tables():
    from dsv4_cluster.workers.engine.decode_graphs import capture_sizes, padded_table

    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert capture_sizes(8) == (1, 2, 4, 8) and capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    t = padded_table([[5, 6, 7], [9]], pad=3)
    assert t.dtype == torch.int32 and t.tolist() == [[5, 6, 7], [9, 3, 3]]
