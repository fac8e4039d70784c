"""The embedded engine's kernel path on the CPU: the flash preset's forward with its sparse decode, indexer and
top-k routed to our Triton kernels (run by Triton's interpreter here, tests/conftest.py; on a GPU,
tests/workers/test_cuda_engine.py runs them for real) gives the logits of the reference ops.

This is what the CUDA engine calls, with the engine's own inputs: bf16-free here (float32, the interpreter's
exact dots), so the two paths must agree to float32 rounding; one layer and a narrow model keep it quick.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.core import KERNEL_NAMES
from dsv4_cluster.workers.engine.presets import model_config
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter run; GPUs run test_cuda_engine")


def _runner(kernels: bool, **kw) -> ModelRunner:
    cfg = model_config("flash", seed=0, n_layers=kw.pop("layers", 1), d_model=256, ffn_dim=256,
                       n_heads=kw.pop("heads", 64), topk=kw.pop("topk", 512))
    runner = ModelRunner(RunnerConfig(model=cfg, page_size=kw.pop("page", 16), max_total_tokens=4096,
                                      context_length=4096, **kw))
    if kernels:
        runner.model.ops.route(KERNEL_NAMES, cfg.n_heads, torch.float32)
    return runner


def _run(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    pages = [runner.pool.alloc(len(p) + 8) for p in prompts]
    logits = [torch.stack([runner.prefill(p, pg) for p, pg in zip(prompts, pages)])]
    for step in range(2):
        tokens = [int(t) for t in logits[-1].argmax(-1)]
        logits.append(runner.decode(tokens, [len(p) + step for p in prompts], pages))
    return torch.stack(logits)


def test_engine_on_the_kernels_equals_the_reference_ops():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(32, 127, (n,), generator=g).tolist() for n in (30, 9)]
    ref, ker = _runner(False), _runner(True)
    expected, got = _run(ref, prompts), _run(ker, prompts)
    assert (expected - got).abs().max().item() < 1e-4
    # two prefills (one per prompt) and two decode steps; prefill selects with whole-tensor torch ops
    assert ker.model.ops.counts() == {"sparse_mla_decode": {"triton": 4}, "indexer": {"reference": 2, "triton": 2},
                                      "topk": {"reference": 2, "triton": 2}}
    assert ref.model.ops.counts()["sparse_mla_decode"] == {"reference": 4}


def test_fp8_mixed_ratio_engine_on_the_kernels_equals_the_reference_ops():
    """SGLang's fp8 pages (the kernels read the pool's bytes) and a ratio-128 layer (window + every complete
    entry, extra_lens bounding the read) on top of a ratio-4 one."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(32, 127, (n,), generator=g).tolist() for n in (140, 20)]   # 1 and 0 ratio-128 entries
    # top-64 (V4's is 512): the 140-token prompt has 35 ratio-4 entries, so either width selects all of them, and the
    # interpreter's cost follows the width (its 140 prefill queries each read every selected slot)
    kw = dict(layers=2, heads=16, page=128, kv_dtype="fp8_e4m3", topk=64)
    ref, ker = _runner(False, **kw), _runner(True, **kw)
    expected, got = _run(ref, prompts), _run(ker, prompts)
    assert (expected - got).abs().max().item() < 1e-3
    # per forward one ratio-4 call (triton) and one ratio-128 call (triton: the dense launch), 2 prefills + 2 steps
    assert ker.model.ops.counts() == {"sparse_mla_decode": {"triton": 8}, "indexer": {"reference": 2, "triton": 2},
                                      "topk": {"reference": 2, "triton": 2}}
