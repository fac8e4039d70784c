"""SGLang 0.5.23's own DeepSeek-V4 decode attention backend, stood up without a server (bench + tests).

SGLang's own code, unmodified: `DeepseekV4AttnBackend` (metadata, the CUDA-graph metadata path, forward_c4_indexer,
forward), `dsv4/metadata.py`, `dsv4/indexer.py` (with its torch fallbacks), `DeepSeekV4TokenToKVPool`,
`ReqToTokenPool`, `ForwardBatch`, `RadixAttention`, `ModelConfig` from the committed DeepSeek-V4-Flash config, the
server-args resolution and `load_plugins()`. The model around the backend is not run: per layer the rig hands the
backend what the model would (q padded to 64 heads past the 16 real ones, attn_sink sliced and zero-padded,
save_kv_cache=False) and the ratio-4 layers' projected indexer q / weights (`IndexerInputs`); the other stand-ins,
each with why, are in `sglang_stand_ins.py`. Modes (everything else identical): stock, SGLang's torch fallbacks
for the indexer and top-k where DeepGEMM and the JIT top-k do not load, FlashMLA for decode; plugin, SGLang's
defaults with our kernels installed by `load_plugins()` through the entry point. Also here, for every timing
script over the rig: one step (`eager_step`), SGLang's decode graph capture (`capture`), the timer (`_timed`, L2
flushed), median + IQR (`_spread`) and the pool's shape (`pool_shape`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from .sglang_backend_report import EQ_CASE as _EQ_CASE
from .sglang_stand_ins import install_cpu_stand_ins, install_import_stand_ins, install_stand_ins  # noqa: F401  (its API)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "tests" / "data" / "deepseek-v4-flash"
PAGE = 256
WINDOW = 128
HEADS, REAL_HEADS, DIM = 64, 16, 512
INDEX_HEADS, INDEX_DIM = 64, 128
KERNELS = "sparse_mla_decode,indexer,topk"
MODE_ENV = {
    "stock": {"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1", "SGLANG_DSA_FUSE_TOPK": "0"},
    "plugin": {"SGLANG_OPT_USE_JIT_INDEXER_METADATA": "0", "DSV4_CLUSTER_KERNELS": KERNELS},
}
TOPK_BACKEND = {"stock": "torch", "plugin": "sgl-kernel"}

def set_mode_env(mode: str, device: str = "cuda") -> None:
    """The environment of one mode; call before SGLang is imported (its env switches are read at call time).
    On the CPU the plugin is told the GPU class (sm_90, the H200's) it cannot read from a GPU there."""
    for env in MODE_ENV.values():
        for k in env:
            os.environ.pop(k, None)
    os.environ.update(MODE_ENV[mode])
    if device == "cpu":
        os.environ["DSV4_CLUSTER_GPU_CLASS"] = "sm_90"
    if mode == "plugin":
        os.environ.setdefault("DSV4_CLUSTER_ATTEST_DIR", os.environ.get("OUT", "/tmp") + "/attest")


def load_plugins_and_check(mode: str) -> list[str]:
    """SGLang's own `load_plugins()`; in plugin mode our entry point must have wrapped the dsv4 factory."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    load_plugins()
    # Imported here, not first inside `build`: SGLang keeps flashinfer's ImportError (flashinfer is absent here)
    # in a module global (`_flashinfer_import_error`), and its traceback would hold build's frame, hence that
    # rig's whole pool, for the life of the process (the 43-layer device run ran out of memory at its second
    # context).
    import sglang.srt.layers.attention.deepseek_v4_trtllm_backend  # noqa: F401
    factory = ATTENTION_BACKENDS["dsv4"]
    wrapped = getattr(factory, "dsv4_stock", None) is not None
    if wrapped != (mode == "plugin"):
        raise RuntimeError(f"{mode}: load_plugins() left the dsv4 factory {factory.__name__} "
                           f"({'wrapped' if wrapped else 'stock'}); is the dsv4-cluster entry point on sys.path?")
    return [factory.__name__]


@dataclass
class Rig:
    backend: object
    pool: object
    req_to_token_pool: object
    layers: list  # (RadixAttention, compress_ratio)
    model_config: object
    device: str


def resolve_model_config(context_len: int, mode: str, device: str):
    """SGLang's own argument resolution and ModelConfig for a TP4 decode rank of DeepSeek-V4-Flash."""
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    args = prepare_server_args(["--model-path", str(CONFIG_DIR), "--tp-size", "4", "--context-length",
                                str(context_len), "--page-size", str(PAGE), "--kv-cache-dtype", "fp8_e4m3",
                                "--attention-backend", "dsv4", "--dsa-topk-backend", TOPK_BACKEND[mode],
                                "--device", "cuda", "--disable-cuda-graph"])
    args.resolve_once()
    runtime_context.publish(args, role="scheduler")
    return ModelConfig.from_server_args(args)


def build(context_len: int, max_reqs: int, tokens_per_req: int, mode: str, device: str,
          layer_ids: list[int] | None = None, pool=None) -> Rig:
    """SGLang's pool, req-to-token pool and backend (through the registered `dsv4` factory) for one context.
    `pool`: another rig's (its rows already filled), shared: the pool does not depend on the configured context,
    only the req-to-token pool (its width) and the backend do."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    mc = resolve_model_config(context_len, mode, device)
    ratios = list(mc.compress_ratios)[: mc.num_hidden_layers]
    if layer_ids is not None:  # a subset: the pool holds layers 0..max(id) only (43 would hold ~70 GB at batch 128)
        ratios = ratios[: max(layer_ids) + 1]
    full = (max_reqs * request_pages(tokens_per_req) + 1) * PAGE  # page 0 stays the pad page
    if pool is None:
        pool = _pool(mc, ratios, max_reqs, full, device)
    r2t = ReqToTokenPool(size=max_reqs + 1, max_context_len=mc.context_len, device=device, enable_memory_saver=False)
    runner = SimpleNamespace(
        device=device, model_config=mc, page_size=PAGE, req_to_token_pool=r2t, token_to_kv_pool=pool,
        hisparse_coordinator=None, is_draft_worker=False, spec_algorithm=SpeculativeAlgorithm.from_string(None),
        tp_rank=0, gpu_id=0)
    backend = ATTENTION_BACKENDS["dsv4"](runner)
    ids = list(range(len(ratios))) if layer_ids is None else layer_ids
    layers = [(RadixAttention(REAL_HEADS, DIM, DIM**-0.5, 1, i, v_head_dim=DIM), ratios[i]) for i in ids]
    return Rig(backend, pool, r2t, layers, mc, device)


def _pool(mc, ratios: list[int], max_reqs: int, full: int, device: str):
    """SGLang's DeepSeek-V4 KV pool for `ratios`' layers and `full` token slots, SWA slot = full slot."""
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=max_reqs, swa_size=full, c4_size=full // 4, c128_size=full // 128, c4_state_pool_size=full,
        c128_state_pool_size=max_reqs + 1, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=mc.qk_nope_head_dim,
        qk_rope_head_dim=mc.qk_rope_head_dim, indexer_head_dim=mc.index_head_dim, layer_num=len(ratios),
        device=device, enable_memory_saver=False, compression_ratios=ratios, sliding_window=mc.window_size,
        start_layer=0, end_layer=len(ratios), full_size=full)
    pool.register_mapping(torch.arange(full + PAGE, dtype=torch.int64, device=device))
    return pool


def prepare(mode: str, device: str = "cuda") -> list[str]:
    """SGLang's backend imported and its plugins loaded, `mode`'s env set: the factory. On the GPU machine the
    import-only packages it lacks stand in; on the CPU FlashMLA and torchvision do (apart from `cpu_case`: the
    flashinfer ImportError SGLang keeps holds this frame's callers for good)."""
    from .sglang_stand_ins import install_torchvision_stand_in

    if device == "cpu":
        install_torchvision_stand_in()
    else:
        install_import_stand_ins()
    set_mode_env(mode, device)
    if device == "cpu":
        install_cpu_stand_ins()
    import sglang.srt.layers.attention.deepseek_v4_backend  # noqa: F401

    install_stand_ins(mode, device)
    return load_plugins_and_check(mode)


def cpu_case(mode: str, batch: int, live: int):
    """After `prepare(mode, "cpu")`: layers 0 / 2 / 3 at 8K context, `batch` requests of `live` tokens, decode metadata
    built: (rig, forward batch, layer inputs)."""
    rig = build(8192, batch, live, mode, "cpu", layer_ids=[0, 2, 3])
    fill(rig)
    fb, inputs = decode_batch(rig, batch, live), layer_inputs(rig, batch)
    rig.backend.init_forward_metadata(fb)
    return rig, fb, inputs


class IndexerInputs:
    """Stands in for the model's C4Indexer module, whose projections need model weights: returns the projected fp8 q
    [B, 64, 128] and float32 weights [B, 64, 1] its compute_q would (forward_c4_indexer runs with skip_compressor)."""

    use_fp4_indexer = False

    def __init__(self, layer_id: int, q, weights) -> None:
        self.layer_id, self.q, self.weights = layer_id, q, weights
        self.compressor = None

    def compute_weights(self, x, skip_scale=False):
        return self.weights

    def compute_q(self, q_lora, positions, weight, q_lora_quant=None):
        return self.q, self.weights


def fill(rig: Rig, seed: int = 0) -> None:
    """Random V4 fp8 rows in every layer's window and compressed caches, random fp8 keys in the indexer pools."""
    import torch

    from dsv4_cluster.kernels.indexer.fp8_keys import quantize_keys
    from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout

    gen = torch.Generator(device=rig.device).manual_seed(seed)
    made: dict = {}

    def quantized(buf, tokens_per_page):
        key = (tuple(buf.shape), tokens_per_page)
        if key not in made:
            pages = buf.shape[0]
            kv = torch.randn(pages * tokens_per_page, DIM, generator=gen, device=rig.device)
            made[key] = fp8_layout.quantize_kv_v4(kv, tokens_per_page)
        data = made[key]
        if tuple(data.shape) != tuple(buf.shape):
            raise RuntimeError(f"SGLang's cache buffer {tuple(buf.shape)} is not our V4 layout {tuple(data.shape)}")
        return data

    pool = rig.pool
    for layer, ratio in rig.layers:
        lid = layer.layer_id
        swa = pool.get_swa_key_buffer_radix(lid)
        swa.view(torch.uint8).copy_(quantized(swa, PAGE))
        if ratio:
            extra = pool.get_extra_key_buffer(lid)
            extra.view(torch.uint8).copy_(quantized(extra, pool.get_extra_key_page_size(lid)))
        if ratio == 4:
            idx = pool.get_index_k_with_scale_buffer(lid)
            keys = torch.randn(idx.shape[0], 64, INDEX_DIM, generator=gen, device=rig.device)
            idx.view(torch.uint8).copy_(quantize_keys(keys).view(idx.shape))


def request_pages(live: int) -> int:
    """Whole pages a request of `live` tokens owns in the pool (`decode_batch` lays requests out so; `build` sizes
    the pool by them): its tokens and the one being decoded."""
    return -(-(live + 1) // PAGE)


def decode_batch(rig: Rig, batch: int, live: int):
    """A DECODE ForwardBatch of `batch` requests with `live` tokens each (the last being decoded now):
    request r owns whole pages of the full pool (page 0 is never used), its slots written to req_to_token."""
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    pages = request_pages(live)
    r2t = rig.req_to_token_pool.req_to_token
    req = torch.arange(1, batch + 1, dtype=torch.int64, device=rig.device)
    for r in range(batch):
        base = (1 + r * pages) * PAGE
        r2t[r + 1, :live] = torch.arange(base, base + live, dtype=torch.int32, device=rig.device)
    seq = torch.full((batch,), live, dtype=torch.int64, device=rig.device)
    out_loc = r2t[req, live - 1].to(torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=batch,
                        input_ids=torch.zeros(batch, dtype=torch.int64, device=rig.device), req_pool_indices=req,
                        seq_lens=seq, out_cache_loc=out_loc, seq_lens_sum=batch * live,
                        seq_lens_cpu=seq.cpu(), positions=seq - 1)


def layer_inputs(rig: Rig, batch: int, seed: int = 1) -> list[dict]:
    """Per layer what the model hands the backend: q [B, 64, 512] bf16 (16 real heads, rows past them
    new_empty as SGLang leaves them), attn_sink [64] (16 real, zero pad), and the indexer's inputs."""
    import torch

    gen = torch.Generator(device=rig.device).manual_seed(seed)
    out = []
    for layer, ratio in rig.layers:
        q = torch.empty(batch, HEADS, DIM, dtype=torch.bfloat16, device=rig.device)
        q[:, :REAL_HEADS] = torch.randn(batch, REAL_HEADS, DIM, generator=gen, device=rig.device).to(torch.bfloat16)
        sink = torch.zeros(HEADS, dtype=torch.float32, device=rig.device)
        sink[:REAL_HEADS] = torch.randn(REAL_HEADS, generator=gen, device=rig.device)
        one = {"q": q, "sink": sink, "indexer": None}
        if ratio == 4:
            iq = (torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=gen, device=rig.device) * 2)
            w = torch.randn(batch, INDEX_HEADS, 1, generator=gen, device=rig.device) * 0.1
            one["indexer"] = IndexerInputs(layer.layer_id, iq.to(torch.float8_e4m3fn), w)
        out.append(one)
    return out


def run_layers(rig: Rig, fb, inputs: list[dict], keep=None) -> list:
    """One decode step of the attention backend after its metadata is built: per ratio-4 layer SGLang's
    forward_c4_indexer, then per layer SGLang's forward (q padded to 64 heads, output sliced to the 16)."""
    backend, outs = rig.backend, []
    x = inputs[0]["q"][:, :1, :1]
    for (layer, ratio), one in zip(rig.layers, inputs):
        if ratio == 4:
            backend.forward_c4_indexer(x=x, q_lora=x, c4_indexer=one["indexer"], forward_batch=fb,
                                       skip_compressor=True)
            if keep is not None:
                keep.append(backend.forward_metadata.core_metadata.c4_sparse_page_indices.clone())
        o = backend.forward(q=one["q"], k=x, v=x, layer=layer, forward_batch=fb, compress_ratio=ratio,
                            attn_sink=one["sink"], save_kv_cache=False)
        outs.append(o[:, :REAL_HEADS])
    return outs


def _timed(fn, reps: int, flush) -> float:
    import torch

    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def eager_step(r: Rig, fb, inputs, keep=None):
    r.backend.init_forward_metadata(fb)
    return run_layers(r, fb, inputs, keep)


def capture(r: Rig, fb, inputs):
    """SGLang's decode graph capture for this batch size; returns (graph, outputs, replay step)."""
    import torch

    backend = r.backend
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend.init_forward_metadata_in_graph(fb)
            run_layers(r, fb, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    backend.on_after_cuda_graph_warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(fb)
        outs = run_layers(r, fb, inputs)

    def replay():
        backend.init_forward_metadata_out_graph(fb)
        graph.replay()

    replay.reads = inputs  # the graph reads these tensors: they live as long as the replay (paired drops its own)
    return graph, outs, replay


def _spread(times: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0], 0, times[0])
    return {"median": statistics.median(times), "iqr": q3 - q1}


def pool_shape(batches: list[int], live: int) -> tuple[int, int]:
    """(requests, tokens a request) of the pool: room for the largest batch at `live` tokens and for the equality
    case, which `decode_batch` lays out in whole pages from the pool's start. The equality case's 4,096 tokens for
    every one of 128 requests made the 43-layer pool ~70 GB, more than an H100 holds; its 8 requests fit in what
    128 x 2,048 tokens take."""
    max_reqs = max(batches + [_EQ_CASE["batch"]])
    if max_reqs * request_pages(live) >= _EQ_CASE["batch"] * request_pages(_EQ_CASE["live"]):
        return max_reqs, live
    return max_reqs, max(live, _EQ_CASE["live"])
