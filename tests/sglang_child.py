"""Child process for the SGLang contract tests: SGLang's own code, run where it cannot pollute pytest.

    python -m tests.sglang_child resolve '<argvs as JSON>'  -> resolved fields per argv, JSON
    python -m tests.sglang_child plugin                     -> what load_plugins() did, as JSON
    python -m tests.sglang_child install DIR                -> our factory on SGLang's classes
    python -m tests.sglang_child capacity '<cases as JSON>' -> SGLang's own DeepSeek-V4 pool sizing
    python -m tests.sglang_child server_info '[[argv, N]...]' -> /server_info's bodies, by SGLang

torchvision: SGLang's config package imports `torchvision.transforms` at module level (for vision
models' preprocessing), and no torchvision build loads beside the CPU torch 2.13 (every registry build
links torch's CUDA libraries). Argument resolution of a text model never calls it, so this child puts
an import-only stand-in on the import path; any *use* of it raises. The stand-in is the only thing here
that is not SGLang's own code, and it is not what is under test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.sglang_stand_ins import install_torchvision_stand_in as _install_torchvision_stand_in

RESOLVED_FIELDS = ("page_size", "kv_cache_dtype", "attention_backend", "context_length", "tp_size",
                   "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
                   "base_gpu_id", "gpu_id_step", "numa_node", "port", "nccl_port", "served_model_name",
                   "reasoning_parser", "tool_call_parser", "enable_metrics", "enable_cache_report", "random_seed")


def resolve(argv: list[str]) -> dict[str, Any]:
    """SGLang's parser, then its model-aware resolution; the fields the plan relies on."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    parsed = {k: getattr(args, k) for k in ("page_size", "kv_cache_dtype", "tp_size", "numa_node")}
    args.resolve_once()
    resolved = args.resolved_dict()
    return {"parsed": parsed, "resolved": {k: resolved.get(k) for k in RESOLVED_FIELDS}}


def plugin() -> dict[str, Any]:
    """Run SGLang's real `load_plugins()` and report what became of the `dsv4` factory."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    before = ATTENTION_BACKENDS.get("dsv4")
    load_plugins()
    after = ATTENTION_BACKENDS.get("dsv4")
    return {"stock_name": getattr(before, "__name__", None), "name": getattr(after, "__name__", None),
            "wraps_stock": getattr(after, "dsv4_stock", None) is before and before is not None,
            "replaced": after is not before}


def install(attest_dir: str) -> dict[str, Any]:
    """Our factory around SGLang's real DeepseekV4AttnBackend class, as far as a CPU allows.

    A real backend needs a GPU model runner, so the instance is made with `__new__` and given the
    `functools.partial(..., use_legacy=...)` SGLang 0.5.23's `__init__` binds; everything else (the
    class, the call-site modules, the plugin's checks, the attestation, the counters) is real."""
    import functools
    from types import SimpleNamespace

    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from dsv4_cluster.kernels.sglang_plugin import installing_factory
    from dsv4_cluster.kernels.sglang_plugin.attestation import read_json
    from dsv4_cluster.kernels.sglang_plugin.install import PluginInstallError
    from dsv4_cluster.kernels.sglang_plugin.settings import PluginSettings

    def stock_flash_mla(*args: Any, **kwargs: Any) -> Any:
        return "stock FlashMLA", sorted(kwargs)  # what the route table leaves stock reaches SGLang's own partial

    def backend() -> Any:
        b = DeepseekV4AttnBackend.__new__(DeepseekV4AttnBackend)
        b._flash_mla_with_kvcache = functools.partial(stock_flash_mla, use_legacy=True)
        return b

    def backend_v41() -> Any:
        b = backend()
        b.is_dsv41 = True  # what SGLang's __init__ sets for a config.json model_type deepseek_v41
        return b

    out: dict[str, Any] = {}
    # "ok" first: a module site keeps the counted wrapper of the first install in the process, hence its counters
    for case, kernels, make, gpu in (("ok", ("sparse_mla_decode", "topk"), backend, "sm_90"),
                                     ("v41", ("sparse_mla_decode",), backend_v41, "sm_90"),
                                     ("indexer", ("sparse_mla_decode", "indexer", "topk"), backend, "sm_90"),
                                     ("not_dsv4", ("sparse_mla_decode",), lambda: SimpleNamespace(), "sm_90"),
                                     ("sm120", ("sparse_mla_decode", "topk"), backend, "sm_120"),
                                     ("no_class", ("sparse_mla_decode",), backend, None)):
        settings = PluginSettings(kernels=kernels, attest_dir=f"{attest_dir}/{case}", worker="decode-0", gpu_class=gpu)
        factory = installing_factory(lambda runner, make=make: make(), settings)
        try:
            b = factory(SimpleNamespace(device="cpu", tp_rank=1, gpu_id=5))
        except PluginInstallError as e:
            out[case] = {"error": str(e)}
            continue
        routed = b._flash_mla_with_kvcache
        partial = getattr(routed, "dsv4_stock", routed)
        import torch

        q = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16)  # B = 1, window-only: stock on sm_90 (decode_routes)
        from sglang.kernels.ops.attention import flash_mla_sm120
        from sglang.kernels.ops.attention.dsv4 import topk as topk_module
        from sglang.srt.layers.attention.dsv4 import indexer as indexer_module

        out[case] = {"flash_mla_keywords": partial.keywords,
                     "flash_mla_adapter": getattr(routed, "dsv4_adapter", partial.func).__module__,
                     "hooked": getattr(DeepseekV4AttnBackend, "dsv4_cluster_hooked", False),
                     "sm120_adapter": getattr(flash_mla_sm120.flash_mla_with_kvcache_sm120, "dsv4_adapter",
                                              flash_mla_sm120.flash_mla_with_kvcache_sm120).__module__,
                     "topk_adapters": [topk_module.topk_transform_paged_v2.dsv4_adapter.__module__,
                                       indexer_module.topk_transform_paged_v2.dsv4_adapter.__module__],
                     "attestation": read_json(Path(settings.attest_dir) / "rank1.json"),
                     "counters": read_json(Path(settings.attest_dir) / "counters-rank1.json")}
        out[case]["stock_call"] = routed(q=q, k_cache=None) if gpu == "sm_90" else None
        if case == "ok":  # SGLang's own metadata entry reaches our builder, counted (the publisher's next write)
            import time

            from sglang.kernels.ops.attention.dsv4 import attn_metadata_kernels, metadata_kernel

            lens = torch.tensor([300, 5], dtype=torch.int32)
            built = metadata_kernel.init_compression_metadata(lens, lens - 1, torch.zeros(2, dtype=torch.int64),
                                                               torch.full((2, 4), 3, dtype=torch.int32), 256)
            out[case]["metadata_adapters"] = [
                metadata_kernel._init_compressed_attn_metadata_triton.dsv4_adapter.__module__,
                attn_metadata_kernels.build_page_table_positions_triton.dsv4_adapter.__module__]
            out[case]["metadata_call"] = built[8].tolist()
            time.sleep(2.5)
            out[case]["counters_later"] = read_json(Path(settings.attest_dir) / "counters-rank1.json")
    return out


def _walk_bytes(obj: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of every tensor (not view) an SGLang pool object holds."""
    import torch

    if id(obj) in seen or depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.nbytes if obj._base is None else 0
    if isinstance(obj, (list, tuple)):
        return sum(_walk_bytes(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(_walk_bytes(x, seen, depth + 1) for x in obj.values())
    if type(obj).__module__.startswith("sglang") and hasattr(obj, "__dict__"):
        return sum(_walk_bytes(x, seen, depth + 1) for x in vars(obj).values())
    return 0


def capacity(case: dict[str, Any]) -> dict[str, Any]:
    """SGLang's own sizing of the DeepSeek-V4 KV pool for one server.

    The argv goes through SGLang's resolution with `get_device_memory_capacity` answering
    `gpu_total_mib` (its default memory fraction reads it); then a real `KVCacheConfigurator` (built
    with `object.__new__` and the fields ModelRunner would give it, since ModelRunner needs a GPU) runs
    its `_resolve_memory_pool_config` with the measured inputs fed in: `get_available_gpu_memory`
    answers `free_after_load_gib` and `pre_gib` is the pre-load measurement. The pool is then built by
    SGLang's `DeepSeekV4TokenToKVPool` on device "meta" and its tensors' bytes summed."""
    import torch
    from types import SimpleNamespace

    import sglang.srt.arg_groups.memory_hook as memory_hook
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache import kv_cache_configurator as kcm
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    memory_hook.get_device_memory_capacity = lambda device=None: float(case["gpu_total_mib"])
    args = prepare_server_args(case["argv"])
    args.resolve_once()
    runtime_context.publish(args, role="scheduler")
    mc = ModelConfig.from_server_args(args)
    tp = args.resolved_dict()["tp_size"]
    kcm.get_available_gpu_memory = lambda *a, **k: float(case["free_after_load_gib"])
    kcm.get_parallel = lambda: SimpleNamespace(launch_world_size=tp, pp_size=1, attn_dcp_size=1,
                                               world_group=SimpleNamespace(cpu_group=None))
    layers = mc.num_hidden_layers
    kvc = object.__new__(kcm.KVCacheConfigurator)
    fields = dict(
        device="cuda", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None, model_config=mc,
        server_args=args, kv_cache_dtype=torch.float8_e4m3fn, kv_cache_dtype_str=args.resolved_dict()["kv_cache_dtype"],
        model_dtype=torch.bfloat16, page_size=args.resolved_dict()["page_size"], sliding_window_size=mc.window_size,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False, post_capture_kv_active=False,
        spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa, is_hybrid_swa_compress=True, use_mla_backend=True,
        layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
        draft_parallel_layout=None, draft_model_idx=None, extra_mamba_cache_bytes_per_req=0, mambaish_config=None,
        hybrid_gdn_config=None, hybrid_kda_config=None, kv_shard_rank=None, kv_shard_size=1, kv_shard_spec=None,
        kv_shard_group=None, is_hybrid_swa_mtp_draft=False, draft_swa_full_capacity=False,
        dflash_draft_cell_size_per_token=None)
    for name, value in fields.items():
        setattr(kvc, name, value)
    configurator = create_memory_pool_configurator(kvc)
    available = kcm.KVCacheConfigurator._profile_available_bytes(kvc, case["pre_gib"])
    config = kcm.KVCacheConfigurator._resolve_memory_pool_config(kvc, case["pre_gib"])
    mrr = config.max_running_requests
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=mrr, swa_size=config.swa_max_total_num_tokens, c4_size=config.c4_max_total_num_tokens,
        c128_size=config.c128_max_total_num_tokens, c4_state_pool_size=config.c4_state_pool_size,
        c128_state_pool_size=config.c128_state_pool_size, page_size=kvc.page_size, swa_page_size=kvc.page_size,
        dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
        qk_nope_head_dim=mc.qk_nope_head_dim, qk_rope_head_dim=mc.qk_rope_head_dim,
        indexer_head_dim=mc.index_head_dim, layer_num=layers, device="meta", enable_memory_saver=False,
        compression_ratios=mc.compress_ratios, sliding_window=mc.window_size, start_layer=0, end_layer=layers,
        full_size=config.max_total_num_tokens)
    return {"configurator": type(configurator).__name__, "mem_fraction_static": config.mem_fraction_static,
            "available_bytes": available, "bytes_per_full_token": configurator.bytes_per_full_token,
            "bytes_per_swa_token": configurator.bytes_per_swa_token,
            "c128_state_bytes": configurator._get_c128_state_fixed_bytes(
                configurator.requested_max_running_requests_per_worker),
            "max_total_num_tokens": config.max_total_num_tokens,
            "swa_max_total_num_tokens": config.swa_max_total_num_tokens, "max_running_requests": mrr,
            "meta_pool_bytes": _walk_bytes(pool, set())}


def server_info(argv: list[str], max_total_num_tokens: int) -> dict[str, Any]:
    """The body SGLang 0.5.23's `/server_info` returns for a server with `argv` and this pool size, built by
    its own functions the way `http_server.server_info` does: the scheduler's `get_init_info` (called on a
    stand-in scheduler carrying the fields it reads), `build_server_info`, one DP rank's internal state
    with `build_memory_usage`; only the memory numbers are made up."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.memory_usage import build_memory_usage
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import build_server_info
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
    from sglang.version import __version__

    args = prepare_server_args(argv)
    args.resolve_once()
    runtime_context.publish(args, role="scheduler")
    scheduler = SimpleNamespace(max_total_num_tokens=max_total_num_tokens, max_req_input_len=131071,
                                startup_time=1.0, _hicache_l3_layout=lambda: None)
    state = dict(args.resolved_dict())
    state["memory_usage"] = build_memory_usage(
        weight_gb=37.2, kv_cache_gb=90.1, startup_available_gb=139.4, token_capacity=max_total_num_tokens,
        token_capacity_swa=max_total_num_tokens // 10, target_graph_memory_usage=None,
        draft_graph_memory_usage=None)
    body = {**build_server_info(args, Scheduler.get_init_info(scheduler)), "startup_time": 1.0,
            "internal_states": [state], "version": __version__, "frontend": "python"}
    return json.loads(json.dumps(msgspec_to_builtins(redact_watermark_secrets(body)), default=str))


def main(argv: list[str]) -> int:
    _install_torchvision_stand_in()
    if argv[0] == "resolve":
        out = [resolve(one) for one in json.loads(argv[1])]  # one interpreter: SGLang imports take ~20 s
    elif argv[0] == "plugin":
        out = plugin()
    elif argv[0] == "install":
        out = install(argv[1])
    elif argv[0] == "server_info":
        out = [server_info(one, int(n)) for one, n in json.loads(argv[1])]
    elif argv[0] == "capacity":
        out = [capacity(case) for case in json.loads(argv[1])]
    else:
        raise SystemExit(f"unknown command {argv[0]!r}; use resolve, plugin, install, capacity or server_info")
    print("RESULT " + json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
