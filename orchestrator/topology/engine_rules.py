"""The topology rules of each engine: what SGLang needs (weights, NCCL ports, CUDA, its KV layout) and
what the embedded engine's workers would refuse at start (workers/args.py), said before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

from dsv4_cluster.orchestrator.launch.sglang_facts import DSV4_PAGE_SIZE, SGLANG_KV_DTYPE, SGLANG_V4_KV_DTYPE
from .rule_context import Finding, Path_, RuleContext, WorkerEntry, as_int, field_value
from .schema import KernelsConfig, KvCacheDtype, WorkerConfig

EMBEDDED_COMPRESS_RATIO = 4  # one compressed (C4) KV entry per 4 tokens; pages must hold whole entries


def engine_needs(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.engine == "sglang":
        if ctx.section("model").get("path") is None and isinstance(ctx.data.get("model"), dict):
            yield Finding(("model", "path"), "engine sglang needs the weights, model.path is not set",
                          "set model.path to a Hugging Face id or local folder, e.g. deepseek-ai/DeepSeek-V4-Flash")
        if ctx.section("transfer").get("backend") == "tcp":
            yield Finding(("transfer", "backend"), "SGLang has no tcp KV transfer backend",
                          "use backend: nixl (neither engine has a tcp KV transfer)")
        for w in ctx.workers:
            if w.raw.get("nccl_port") is None:
                yield Finding(w.path + ("nccl_port",), f"engine sglang needs an nccl_port for {w.label}",
                              "add nccl_port: <free port> (the TP group's NCCL rendezvous)")
            if field_value(w.raw, WorkerConfig, "device") == "cpu":
                yield Finding(w.path + ("device",), f"engine sglang serves on CUDA only, {w.label} is on cpu",
                              "set device: cuda with gpus and tp, or use engine: embedded on CPU")
            gpus = w.raw.get("gpus")
            if isinstance(gpus, list) and gpus and all(as_int(g) is not None for g in gpus) \
                    and gpus != list(range(gpus[0], gpus[0] + len(gpus))):
                yield Finding(w.path + ("gpus",), f"engine sglang places {w.label}'s TP ranks on --base-gpu-id and the "
                              f"GPUs after it, so its GPUs must be consecutive and ascending; got {gpus}",
                              f"list consecutive GPUs, e.g. {list(range(min(gpus), min(gpus) + len(gpus)))}")
        yield from _sglang_kv_layout(ctx)
    if ctx.engine == "embedded":
        yield from _embedded_options(ctx)
        lacking = [w.label for w in ctx.workers if ctx.resolved(w, "max_total_tokens")[0] is None]
        if lacking:
            yield Finding(("defaults", "max_total_tokens"), f"the embedded engine needs a KV pool size; "
                          f"{', '.join(lacking)} have none", "set defaults.max_total_tokens (e.g. 16384) or "
                          "max_total_tokens on each worker")
        for _, size, path in _once(ctx, "page_size"):
            if as_int(size) and size > 0 and size % EMBEDDED_COMPRESS_RATIO:
                yield Finding(path, f"page_size {size} is not a multiple of {EMBEDDED_COMPRESS_RATIO} (the embedded "
                              "model's compression ratio: a page must hold whole compressed entries)",
                              "use a multiple of 4, e.g. 16 or 64")


def _once(ctx: RuleContext, key: str) -> Iterator[tuple[WorkerEntry, Any, Path_]]:
    """Each distinct place the file sets `key` (a worker or defaults), with its resolved value, once."""
    reported: set[Path_] = set()
    for w in ctx.workers:
        value, path = ctx.resolved(w, key)
        if path not in reported:
            reported.add(path)
            yield w, value, path


def _sglang_kv_layout(ctx: RuleContext) -> Iterator[Finding]:
    """SGLang 0.5.23 DeepSeek-V4: 256-token pages whatever it is told; fp8 KV whatever the kernels."""
    for w, size, path in _once(ctx, "page_size"):
        if ctx.written(w, "page_size") and as_int(size) is not None and size != DSV4_PAGE_SIZE:
            yield Finding(path, f"page_size {size}: SGLang 0.5.23 runs DeepSeek-V4 with {DSV4_PAGE_SIZE}-token pages "
                          "whatever --page-size says", f"set page_size: {DSV4_PAGE_SIZE}, or remove it")
    for w, dtype, path in _once(ctx, "kv_cache_dtype"):
        if dtype not in SGLANG_KV_DTYPE:
            yield Finding(path, f"kv_cache_dtype {dtype}: SGLang 0.5.23 keeps DeepSeek-V4's KV in {SGLANG_V4_KV_DTYPE} "
                          "only (--kv-cache-dtype bfloat16 passes its parser, then its V4 KV pool asserts uint8 rows "
                          "at start, after the weights loaded)", "set kv_cache_dtype: auto, or remove it")


def _embedded_options(ctx: RuleContext) -> Iterator[Finding]:
    """What the embedded engine's workers would refuse at start (workers/args.py), said before anything starts."""
    if ctx.section("transfer").get("backend") == "tcp":
        yield Finding(("transfer", "backend"), "the embedded engine moves KV over NIXL only (no tcp backend)",
                      "use backend: nixl (neither engine has a tcp KV transfer)")
    raw_kernels = ctx.section("kernels") or {}
    kernels = [k for k, f in KernelsConfig.model_fields.items() if raw_kernels.get(k, f.default) is True]
    for w in ctx.workers:
        if field_value(w.raw, WorkerConfig, "device") == "cuda" and kernels and embedded_preset(w.raw) != "flash":
            yield Finding(w.path + ("device",), f"{w.label} runs the embedded engine on cuda with kernels "
                          f"{', '.join(kernels)}, but its model preset is {embedded_preset(w.raw)!r}, whose shapes "
                          "the kernels do not take (they take 512 dims, 16/32/64 heads)",
                          'add extra_args: ["--model-preset", "flash"] (examples/gpu.yaml), or set the kernels off')
        gpus = field_value(w.raw, WorkerConfig, "gpus")
        if field_value(w.raw, WorkerConfig, "device") == "cuda" and isinstance(gpus, list) and len(gpus) > 1:
            yield Finding(w.path + ("gpus",), f"{w.label} lists {len(gpus)} GPUs, but an embedded worker is one "
                          "process on one GPU (no tensor parallelism)",
                          "list one GPU (e.g. gpus: [1]); more workers take more GPUs (examples/gpu2.yaml)")
    yield from _embedded_kv_layout(ctx)


def _embedded_kv_layout(ctx: RuleContext) -> Iterator[Finding]:
    """kv_cache_dtype and page_size against each worker's preset, as the worker checks them (workers/args.py)."""
    from dsv4_cluster.workers.engine.presets import PRESETS, KVDtypeError, kv_layout_dtype, pool_layout

    reported: set[Path_] = set()
    for w in ctx.workers:
        dtype, dtype_path = ctx.resolved(w, "kv_cache_dtype")
        page, page_path = ctx.resolved(w, "page_size")
        cfg = PRESETS.get(embedded_preset(w.raw))
        if (dtype not in get_args(KvCacheDtype) or as_int(page) is None or page <= 0 or page % EMBEDDED_COMPRESS_RATIO
                or cfg is None):
            continue
        try:
            layout = kv_layout_dtype(dtype, cfg, str(field_value(w.raw, WorkerConfig, "device")))
        except KVDtypeError as exc:
            found = (dtype_path, str(exc), "set kv_cache_dtype: auto, or remove it")
        else:
            problems = pool_layout(cfg, layout, page, 1).problems()
            found = (page_path, f"{w.label} ({embedded_preset(w.raw)} preset, KV {layout}): " + "; ".join(problems),
                     "set page_size: 256") if problems else None
        if found and found[0] not in reported:
            reported.add(found[0])
            yield Finding(*found)


def embedded_preset(raw: dict) -> str:
    """The `--model-preset` an embedded worker's extra_args pass (workers/engine/presets.py), else the default 'tiny'."""
    args = [str(a) for a in raw.get("extra_args") or []]
    for i, a in enumerate(args):
        if a == "--model-preset" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--model-preset="):
            return a.split("=", 1)[1]
    return "tiny"
