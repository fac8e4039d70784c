"""Installing the adapters into one SGLang TP process, from inside the `dsv4` backend factory.

Why the factory: SGLang only logs an exception raised in a plugin's `register()`, but one raised by
the attention-backend factory fails model init, so `launch_server` exits and `up` names the reason
(fail closed). The factory runs in `Scheduler.init_model_worker` before `init_all_cuda_graphs`, so
the adapters are in place when SGLang warms up and captures its CUDA graphs; a patch after capture
would leave every replay on the stock kernels.

Each adapter is wrapped so that every call also adds 1 to its slot of a device counter; that add is
captured into the CUDA graphs, so replays advance it too (a Python counter would only see warm-up and
capture). `attestation.py` publishes the install and the counters for `dsv4-cluster verify`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

from dsv4_cluster.core import KERNEL_NAMES

from .attestation import METADATA, STOCK_DECODE
from .call_sites import (
    BACKEND_ATTR, BACKEND_CLASS, BACKEND_MODULE, CallSite, CallSiteError, check_call_site, sites_for, truthy)
from .settings import SGLANG_VERSION, PluginSettings

# SGLang env switches that route the DeepSeek-V4 indexer away from every site the plugin replaces (per class:
# on sm_120 the torch switch routes it to fp8_paged_mqa_logits_torch_sm120, which the plugin replaces).
INDEXER_DETOURS = {"sm_90": ("SGLANG_OPT_USE_TILELANG_INDEXER", "SGLANG_OPT_USE_AITER_INDEXER",
                             "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"),
                   "sm_100": ("SGLANG_OPT_USE_TILELANG_INDEXER", "SGLANG_OPT_USE_AITER_INDEXER",
                              "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"),
                   "sm_120": ("SGLANG_OPT_USE_TILELANG_INDEXER", "SGLANG_OPT_USE_AITER_INDEXER")}


class PluginInstallError(RuntimeError):
    """A requested kernel cannot be installed into this SGLang process; model init must fail."""


def preconditions(settings: PluginSettings, gpu: str) -> list[str]:
    """Why the requested kernels cannot be installed in this process on GPU class `gpu`; empty when they can."""
    problems = []
    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != SGLANG_VERSION:
        problems.append(f"SGLang {found} is not {SGLANG_VERSION}, the release whose call sites the plugin knows")
        return problems
    for site in sites_for(gpu, env=os.environ):
        if site.kernel in settings.kernels:
            try:
                check_call_site(site)
            except CallSiteError as e:
                problems.append(f"{site.kernel}: {e}")
    if "indexer" in settings.kernels:
        detours = [name for name in INDEXER_DETOURS[gpu] if truthy(os.environ.get(name))]
        if detours:
            problems.append(f"indexer: {', '.join(detours)} routes SGLang's indexer away from "
                            "deep_gemm.fp8_paged_mqa_logits; unset it")
    return problems


class Counters:
    """One int64 per kernel on the model's device, one for the decode calls the route table left on SGLang's
    stock kernel (`STOCK_DECODE`), one for our decode-metadata builds (`METADATA`); `bump` is an in-place device
    add (graph-captured)."""

    NAMES = (*KERNEL_NAMES, STOCK_DECODE, METADATA)

    def __init__(self, device: Any) -> None:
        import torch

        self.values = torch.zeros(len(self.NAMES), dtype=torch.int64, device=device)

    def bump(self, kernel: str) -> None:
        i = self.NAMES.index(kernel)
        self.values[i:i + 1].add_(1)

    def counted(self, kernel: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.bump(kernel)
            return fn(*args, **kwargs)

        call.dsv4_adapter = fn  # type: ignore[attr-defined]
        return call


def adapter_for(site: CallSite) -> Callable[..., Any]:
    """Our drop-in for one SGLang call site."""
    try:
        from dsv4_cluster.kernels import sglang_adapters as a
    except ImportError as e:
        raise PluginInstallError(f"the kernel adapters do not import: {e}") from e
    if site.metadata:
        from dsv4_cluster.kernels.sglang_adapters import metadata

        return getattr(metadata, site.attr)
    if site.kernel == "sparse_mla_decode":
        return a.flash_mla_with_kvcache if site.on_backend else a.flash_mla_with_kvcache_sm120
    return a.fp8_paged_mqa_logits if site.kernel == "indexer" else a.topk_transform_paged_v2


def install_module_sites(settings: PluginSettings, counters: Counters, gpu: str) -> dict[str, list[str]]:
    """Replace the module-level call sites of class `gpu` once per process; returns where, per kernel."""
    placed: dict[str, list[str]] = {}
    for site in sites_for(gpu, env=os.environ):
        if site.kernel not in settings.kernels or site.on_backend:
            continue
        try:
            module = importlib.import_module(site.module)
        except ImportError as e:
            raise PluginInstallError(f"{site.kernel}: cannot import {site.module} to replace {site.attr}: {e}") from e
        current, adapter = getattr(module, site.attr, None), adapter_for(site)
        if getattr(current, "dsv4_adapter", None) is not adapter:
            wrapper = counters.counted(METADATA if site.metadata else site.kernel, adapter)
            wrapper.dsv4_stock = current  # type: ignore[attr-defined]  (SGLang's: the metadata builders call it)
            setattr(module, site.attr, wrapper)
        placed.setdefault(site.kernel, []).append(f"{site.module}.{site.attr}")
    return placed


def check_backend(backend: Any, settings: PluginSettings) -> None:
    """Refuse a backend whose calls go around the replaced sites (see call_sites.STOCK)."""
    module = importlib.import_module(BACKEND_MODULE)
    if "sparse_mla_decode" in settings.kernels:
        if not isinstance(backend, getattr(module, BACKEND_CLASS)):
            raise PluginInstallError(f"sparse_mla_decode: the dsv4 factory built a {type(backend).__name__}, not a "
                                     f"{BACKEND_CLASS}; its decode does not go through {BACKEND_ATTR}")
        if getattr(backend, "is_dsv41", False):
            raise PluginInstallError("sparse_mla_decode: a DeepSeek-V4.1 checkpoint keeps 528 / 288-byte KV rows; the "
                                     "decode kernel reads V4's 584-byte rows: set kernels.sparse_mla_decode: false")
        if getattr(backend, "trtllm_attn", False):
            raise PluginInstallError("sparse_mla_decode: --dsv4-attn-backend trtllm decodes with trtllm-gen on its own "
                                     "pool layout; drop the flag or the kernel")
    if "indexer" in settings.kernels and getattr(backend, "enable_deepseek_v4_fp4_indexer", False):
        raise PluginInstallError("indexer: --enable-deepseek-v4-fp4-indexer scores FP4 keys with "
                                 "deep_gemm.fp8_fp4_paged_mqa_logits, which the plugin does not replace; drop one")
    topk_backend = getattr(backend, "dsa_topk_backend", None)
    if "topk" in settings.kernels and topk_backend is not None and not topk_backend.should_use_topk_v2():
        raise PluginInstallError(f"topk: --dsa-topk-backend {topk_backend.value} / SGLANG_OPT_USE_TOPK_V2 routes "
                                 "the top-k away from topk_transform_paged_v2; use sgl-kernel with v2")


def install_on_backend(backend: Any, settings: PluginSettings, counters: Counters, gpu: str,
                       check: bool = True) -> list[str]:
    """Bind the routed decode (`routing.routed_decode`: ours where the route table says so, else the stock partial
    SGLang bound) on one DeepSeek-V4 backend instance (sm_90 / sm_100); returns where. `check`: refuse a backend
    whose decode goes around it (the registry's backend; the per-step draft backends are hooked unchecked)."""
    from .routing import routed_decode

    if check:
        check_backend(backend, settings)
    sites = [s for s in sites_for(gpu, "sparse_mla_decode") if s.on_backend]
    if "sparse_mla_decode" not in settings.kernels or not sites:
        return []
    stock = getattr(backend, BACKEND_ATTR, None)
    if getattr(stock, "dsv4_stock", None) is not None:
        return [f"{type(backend).__name__}.{BACKEND_ATTR}"]  # routed already (the class hook ran first)
    if not isinstance(stock, functools.partial) or "use_legacy" not in stock.keywords:
        raise PluginInstallError(f"sparse_mla_decode: {type(backend).__name__}.{BACKEND_ATTR} is {stock!r}, not the "
                                 "functools.partial(flash_mla_with_kvcache, use_legacy=...) of SGLang 0.5.23")
    setattr(backend, BACKEND_ATTR, routed_decode(stock, adapter_for(sites[0]), gpu, counters))
    return [f"{type(backend).__name__}.{BACKEND_ATTR}"]


def holds_adapter(target: Any, kernel: str, site: CallSite | None = None) -> bool:
    """Identity check: does this call site hold our (counted) adapter for `kernel` (at `site`; default: the
    kernel's first site, FlashMLA's for the decode)?"""
    from .call_sites import CALL_SITES

    site = site or next(s for s in CALL_SITES if s.kernel == kernel)
    fn = target.func if isinstance(target, functools.partial) else target
    return getattr(fn, "dsv4_adapter", None) is adapter_for(site)
