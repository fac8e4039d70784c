"""SGLang plugin (entry point group `sglang.srt.plugins`): our kernels in every SGLang TP process.

Inert unless `DSV4_CLUSTER_KERNELS` names kernels (the supervisor sets it from the topology); then `register()`
wraps `ATTENTION_BACKENDS["dsv4"]` (docs/sglang.md, "The plugin", has the steps). Anything that stops a requested
kernel from being installed raises from the factory, so model init fails (fail closed): an exception in
`register()` would only be logged.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable
from typing import Any

from .attestation import Attestation, CounterPublisher, write_attestation
from .. import decode_routes
from .call_sites import BACKEND_ATTR, BACKEND_CLASS, BACKEND_MODULE, REGISTRY_KEY, REGISTRY_MODULE
from .install import (
    Counters, PluginInstallError, install_module_sites, install_on_backend, preconditions)
from .routing import hook_backend_class
from .sites import gpu_class_of_runner, kernel_owners, verify_identity
from .settings import KERNELS_ENV, PluginSettings, PluginSettingsError, settings_from_env

logger = logging.getLogger(__name__)
_publishers: list[CounterPublisher] = []  # kept so their threads live as long as the process


def _rank(runner: Any) -> int:
    rank = getattr(runner, "tp_rank", None)
    if rank is None:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().tp_rank
    return int(rank)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def installing_factory(stock: Callable[[Any], Any], settings: PluginSettings) -> Callable[[Any], Any]:
    """The `dsv4` factory with our kernels: SGLang's backend, then the adapters, checked and attested."""
    state: dict[str, Any] = {}

    def create_dsv4_backend_with_dsv4_cluster_kernels(runner: Any) -> Any:
        gpu = gpu_class_of_runner(runner, settings)
        problems = preconditions(settings, gpu)
        if problems:
            raise PluginInstallError(f"dsv4-cluster kernels requested but not installable on {gpu}: "
                                     + "; ".join(problems))
        backend = stock(runner)
        if "counters" not in state:
            state["counters"] = Counters(getattr(runner, "device", "cpu"))
            state["module_sites"] = install_module_sites(settings, state["counters"], gpu)
        counters = state["counters"]
        sites = {k: list(v) for k, v in state["module_sites"].items()}
        backend_sites = install_on_backend(backend, settings, counters, gpu)
        if backend_sites:
            sites["sparse_mla_decode"] = backend_sites + sites.get("sparse_mla_decode", [])  # + its metadata
        verify_identity(backend, settings, gpu)
        # from now on every instance (the speculative draft's per-step backends too) gets the routed decode
        hook_backend_class(_backend_class(), functools.partial(_route_instance, settings, counters, gpu))
        missing = [k for k in settings.kernels if not sites.get(k)]
        if missing:
            raise PluginInstallError(f"kernels {', '.join(missing)} were requested but no call site holds them")
        rank = _rank(runner)
        write_attestation(settings.attest_dir, Attestation(
            worker=settings.worker, rank=rank, pid=os.getpid(), gpu=getattr(runner, "gpu_id", None),
            sglang_version=_version("sglang"), project_version=_version("dsv4-cluster"), call_sites=sites,
            gpu_class=gpu, kernels=kernel_owners(sites),
            decode_routes=decode_routes.describe(gpu) if "sparse_mla_decode" in settings.kernels else {}))
        if "publisher" not in state:
            state["publisher"] = CounterPublisher(settings.attest_dir, rank, counters).start()
            _publishers.append(state["publisher"])
        logger.info("dsv4-cluster kernels installed on rank %d (%s): %s", rank, gpu, sites)
        return backend

    create_dsv4_backend_with_dsv4_cluster_kernels.dsv4_stock = stock  # type: ignore[attr-defined]
    return create_dsv4_backend_with_dsv4_cluster_kernels


def _route_instance(settings: PluginSettings, counters: Counters, gpu: str, backend: Any) -> None:
    """The class hook's install on one more backend instance; one whose decode is not SGLang's FlashMLA partial
    (trtllm-gen) is left alone, as the registry's backend of that kind is refused by `check_backend`."""
    if isinstance(getattr(backend, BACKEND_ATTR, None), functools.partial):
        install_on_backend(backend, settings, counters, gpu, check=False)


def _backend_class() -> type:
    """SGLang's DeepseekV4AttnBackend: every instance of it (and of its subclasses, the speculative draft's per-step
    backends included) gets the routed decode from its `__init__` on (`routing.hook_backend_class`)."""
    return getattr(importlib.import_module(BACKEND_MODULE), BACKEND_CLASS)


def _failing_factory(error: Exception) -> Callable[[Any], Any]:
    def refuse(runner: Any) -> Any:
        raise PluginInstallError(f"dsv4-cluster kernels requested but the plugin is misconfigured: {error}")

    return refuse


def register() -> None:
    """SGLang's plugin hook: wrap the `dsv4` factory when kernels are requested; otherwise do nothing."""
    try:
        settings = settings_from_env()
    except PluginSettingsError as e:
        wrapper = _failing_factory(e)
    else:
        if not settings.active:
            return
        registry = importlib.import_module(REGISTRY_MODULE).ATTENTION_BACKENDS
        stock = registry.get(REGISTRY_KEY)
        if getattr(stock, "dsv4_stock", None) is not None:
            return  # already wrapped in this process
        wrapper = installing_factory(stock, settings) if stock is not None else _failing_factory(
            RuntimeError(f"SGLang registers no {REGISTRY_KEY!r} attention backend"))
    importlib.import_module(REGISTRY_MODULE).ATTENTION_BACKENDS[REGISTRY_KEY] = wrapper
    logger.info("dsv4-cluster plugin wrapped the %r attention backend (%s=%s)", REGISTRY_KEY, KERNELS_ENV,
                os.environ.get(KERNELS_ENV))
