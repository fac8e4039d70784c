"""`up`'s end-to-end check of the embedded engine: one greedy request through the router (prefill -> NIXL -> decode)
must give the tokens of the same prompt run in this process; otherwise the KV transfer lost state. The prompt
spans several pages and outruns the sliding window. SGLang clusters get the answer set instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = "dsv4-cluster checks that KV survives the trip from prefill to decode. " * 2
NEW_TOKENS = 16


class PDCheckError(RuntimeError):
    """The disaggregated output differs from a single-process run, or the request failed."""


@dataclass(frozen=True)
class PDCheck:
    tokens: int
    seconds: float

    def summary(self) -> str:
        return (f"{self.tokens} greedy tokens through prefill -> NIXL -> decode equal a "
                f"single-process run ({self.seconds:.2f}s for the request)")


def router_url(topology: Any) -> str:
    node = topology.node(topology.router.node)
    return f"http://{node.address}:{topology.router.port}"


def single_process_tokens(topology: Any, prompt_ids: list[int]) -> list[int]:
    from dsv4_cluster.orchestrator.launch.plan import requested_kernels
    from dsv4_cluster.orchestrator.topology.engine_rules import embedded_preset
    from dsv4_cluster.workers.engine.presets import model_config
    from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
    from dsv4_cluster.workers.engine.sampling import SamplingParams
    from dsv4_cluster.workers.engine.tokenizer import ByteTokenizer

    decode = topology.decode[0]
    ctx = topology.model.context_length
    pages = -(-ctx // decode.page_size)
    device = decode.device
    # the decode worker's model, device, kernels and KV layout; on CUDA one graph, of batch 1 (what it replays for
    # this request)
    runner = ModelRunner(RunnerConfig(
        model=model_config(embedded_preset({"extra_args": decode.extra_args}), seed=topology.model.seed),
        page_size=decode.page_size, max_total_tokens=pages * decode.page_size, context_length=ctx, device=device,
        kernels=requested_kernels(topology) if device == "cuda" else (), cuda_graph_max_bs=1,
        kv_dtype=str(decode.kv_cache_dtype)))
    tok = ByteTokenizer()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return generate_single_process(runner, prompt_ids, params, tok.eos_token_id)


def check_pd_equivalence(topology: Any, timeout_s: float = 120.0) -> PDCheck:
    from dsv4_cluster.workers.engine.tokenizer import ByteTokenizer

    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                 "ignore_eos": True}}
    url = router_url(topology) + "/generate"
    started = time.monotonic()
    try:
        r = httpx.post(url, json=body, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise PDCheckError(f"the verification request to {url} failed: {e!r}") from e
    seconds = time.monotonic() - started
    if r.status_code != 200:
        raise PDCheckError(f"the verification request to {url} answered {r.status_code}: {r.text[:500]}")
    got = r.json().get("output_ids")
    expected = single_process_tokens(topology, ByteTokenizer().encode(PROMPT))
    if got != expected:
        raise PDCheckError(
            f"greedy tokens through prefill -> NIXL -> decode differ from a single-process run of the "
            f"same engine ({got} vs {expected}): the KV transfer loses or scrambles state; see the "
            "prefill and decode logs")
    return PDCheck(tokens=len(got), seconds=seconds)
