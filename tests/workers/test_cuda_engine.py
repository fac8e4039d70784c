"""The embedded engine on a GPU (skipped without CUDA): the flash preset on our kernels against the reference ops,
eager and under CUDA graphs, the device-side call counters, and a prefill/decode pair on one GPU over NIXL.

The preset as it runs: its ratio-4 and ratio-128 layers (4, 128, 4, 128) and SGLang's fp8 KV layout (the default
on CUDA) at SGLang's 256-token pages. Kernels and reference ops read the same fp8 bytes (the reference dequantises
exactly the rows it reads), so the fp8 rounding is common to both and the tolerance below is unchanged.

Tolerance. Both runs hold the same bf16 weights and KV; what differs is arithmetic inside attention and the
indexer (the kernels accumulate in fp32 in their own order, round P to bf16 before P.V, merge splits; the
reference ops compute in fp32 from the same bf16 values). So logits differ by a little rounding, never by a
different formula. The check is teacher-forced: both runners decode the reference's greedy tokens, every step's
logits must agree within LOGIT_TOL, and the greedy token must be the same at every step whose reference top-2
margin exceeds 2 x LOGIT_TOL (a smaller margin is a near tie that rounding may flip; such steps are counted and
printed, as is the largest difference seen).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from dsv4_cluster.workers.engine.presets import model_config
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, PRINTABLE_IDS, ByteTokenizer

from tests.worker_procs import start_pair, stop_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
KERNELS = ("sparse_mla_decode", "indexer", "topk")
LOGIT_TOL = 0.08        # logits are ~N(0, 1) (rms-normed state @ lm_head of std d_model^-0.5)
STEPS = 24
PAGE = 256          # SGLang's V4 pages: whole ratio-128 entries, the fp8 layout's power of two


def _runner(kernels=KERNELS, graphs: int = 64, context: int = 16384) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model=model_config("flash", seed=0), page_size=PAGE, max_total_tokens=65536,
                                      context_length=context, device="cuda", kernels=kernels,
                                      cuda_graph_max_bs=graphs))
    assert runner.pool.layout.dtype == "fp8_e4m3" and runner.pool.layout.ratios == (4, 128, 4, 128)
    # the graphs' padding page is extra: the capacity is what was asked (the planner's prediction)
    assert runner.pool.capacity_tokens == 65536 and runner.pool.available_tokens == 65536
    return runner


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(PRINTABLE_IDS[:-1])
    # 2600 tokens: 650 compressed entries, so the top-512 is a real choice; 300: fewer than 512 (all taken)
    return [ids[torch.randint(len(ids), (n,), generator=g)].tolist() for n in (2600, 300, 1337)]


def _teacher_forced(runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """Logits [steps, B, V] of decoding `tokens` (one list per prompt) as one batch after prefilling each."""
    pool = runner.pool
    pages = [pool.alloc(len(p) + STEPS + 1) for p in prompts]
    try:
        first = torch.stack([runner.prefill(p, pg) for p, pg in zip(prompts, pages)])
        steps = [first]
        for s in range(STEPS - 1):
            steps.append(runner.decode([t[s] for t in tokens], [len(p) + s for p in prompts], pages))
        return torch.stack(steps).float()
    finally:
        for pg in pages:
            pool.release(pg)


def _greedy(logits: torch.Tensor) -> list[int]:
    """The sampler's greedy choice (printable ids and EOS only) of each row of logits [B, V]."""
    allowed = torch.full((logits.shape[-1],), float("-inf"))
    allowed[list(PRINTABLE_IDS)] = 0
    return (logits.float() + allowed).argmax(-1).tolist()


def _compare(name: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    diff = (ref - got).abs().amax().item()
    allowed = torch.full((ref.shape[-1],), float("-inf"))
    allowed[list(PRINTABLE_IDS)] = 0
    top2 = (ref + allowed).topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    decided = margin > 2 * LOGIT_TOL
    same = (ref + allowed).argmax(-1) == (got + allowed).argmax(-1)
    print(f"{name}: max |logit diff| {diff:.4f} over {ref.shape[0]} steps x {ref.shape[1]} requests; "
          f"{int((~decided).sum())} near-tie steps (margin <= {2 * LOGIT_TOL}); "
          f"greedy tokens equal at {int(same.sum())}/{same.numel()} steps")
    assert diff < LOGIT_TOL, f"{name}: logits differ by {diff:.4f} (> {LOGIT_TOL})"
    assert bool(same[decided].all()), f"{name}: a greedy token differs at a step with margin > {2 * LOGIT_TOL}"


@pytest.fixture(scope="module")
def reference():
    runner = _runner(kernels=())          # reference ops on the GPU, eager
    prompts = _prompts()
    tokens = _greedy_run(runner, prompts)
    logits = _teacher_forced(runner, prompts, tokens)
    assert runner.model.ops.counts()["sparse_mla_decode"] == {"reference": runner.cfg.model.n_layers * 2 * (
        len(prompts) + STEPS - 1)}
    del runner
    torch.cuda.empty_cache()
    return prompts, tokens, logits


def _greedy_run(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """The reference's own greedy continuation of each prompt, decoded as one batch."""
    pool = runner.pool
    pages = [pool.alloc(len(p) + STEPS + 1) for p in prompts]
    try:
        out = [[t] for t in _greedy(torch.stack([runner.prefill(p, pg) for p, pg in zip(prompts, pages)]))]
        for s in range(STEPS - 1):
            logits = runner.decode([o[-1] for o in out], [len(p) + s for p in prompts], pages)
            for o, t in zip(out, _greedy(logits)):
                o.append(t)
        return out
    finally:
        for pg in pages:
            pool.release(pg)


@pytest.mark.parametrize("graphs", [0, 8], ids=["eager", "cuda-graph"])
def test_kernels_match_reference_ops_on_the_flash_preset(reference, graphs):
    prompts, tokens, ref_logits = reference
    runner = _runner(graphs=graphs)
    assert (runner.graphs is not None) == bool(graphs)
    before = runner.model.ops.counts()
    got = _teacher_forced(runner, prompts, tokens)
    _compare(f"kernels ({'graphs' if graphs else 'eager'}) vs reference", ref_logits, got)
    calls = runner.model.ops.counts()
    ratios = runner.cfg.model.layer_ratios
    n4, n128 = ratios.count(4), ratios.count(128)          # indexed layers; window + every entry
    decode_steps = STEPS - 1
    impl = runner.model.ops.impl
    assert calls["indexer"].get("triton", 0) - before["indexer"].get("triton", 0) == n4 * decode_steps
    assert calls["topk"].get("triton", 0) - before["topk"].get("triton", 0) == n4 * decode_steps

    def delta(i: str) -> int:
        return calls["sparse_mla_decode"].get(i, 0) - before["sparse_mla_decode"].get(i, 0)

    forwards = decode_steps + len(prompts)                  # one prefill chunk per prompt
    sd = impl["sparse_mla_decode"]                          # gluon on the H200; ratio-128 calls: triton
    if sd == "gluon":
        assert (delta("gluon"), delta("triton")) == (n4 * forwards, n128 * forwards)
    else:
        assert delta("triton") == (n4 + n128) * forwards
    if graphs:
        assert runner.graphs.replays == decode_steps and runner.eager_steps == 0
    else:
        assert runner.eager_steps == decode_steps


def test_pd_pair_on_one_gpu_equals_a_single_process(tmp_path):
    flags = ["--device", "cuda", "--model-preset", "flash", "--kernels", ",".join(KERNELS), "--page-size", str(PAGE),
             "--max-total-tokens", "65536", "--context-length", "16384", "--cuda-graph-max-bs", "8"]
    env = {**os.environ, "UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "y"}
    pair = start_pair(tmp_path, extra=flags, env=env, ready_timeout_s=600)
    try:
        prompt = "".join(chr(c) for c in _prompts()[2][:700])
        p, d = pair.generate(prompt, 16)
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        info = httpx.get(pair.decode_url + "/server_info", timeout=30).json()
    finally:
        stop_pair(pair)
        out = os.environ.get("DSV4_GPU_LOGS")
        if out:
            for log in pair.logs:
                Path(out, log.name).write_text(log.read_text())
    runner = _runner(graphs=8)
    expected = generate_single_process(runner, ByteTokenizer().encode(prompt),
                                       SamplingParams(max_new_tokens=16, temperature=0), EOS)
    print("decode /server_info kernels:", json.dumps({k: info[k] for k in ("kernels", "kernel_calls",
                                                                         "decode_steps")}))
    assert d.json()["output_ids"] == expected
    assert info["kernels"]["indexer"] == "triton" and info["kernels"]["topk"] == "triton"
    assert info["kv_cache_dtype"] == "fp8_e4m3" and info["page_size"] == PAGE
    assert info["decode_steps"]["cuda_graph_replays"] == 15
