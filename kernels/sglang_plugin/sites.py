"""Which GPU class this SGLang process runs as, and whether the call sites of that class hold our adapters.

The class decides the call sites (call_sites.CALL_SITES: sm_90 / sm_100 replace the backend's FlashMLA partial,
sm_120 the `flash_mla_sm120` entry). It is read from the runner's GPU (compute capability, the dispatch table's
classes), or forced by `DSV4_CLUSTER_GPU_CLASS` (tests; an H200 standing in for sm_120). No CUDA and nothing forced:
the plugin cannot tell which sites SGLang will call, so it refuses (fail closed).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from dsv4_cluster.core import KERNEL_NAMES
from dsv4_cluster.kernels import dispatch

from .call_sites import BACKEND_ATTR, sites_for
from .install import PluginInstallError, holds_adapter
from .settings import PluginSettings


def gpu_class_of_runner(runner: Any, settings: PluginSettings) -> str:
    """The GPU class of the model runner's GPU (or the forced one)."""
    if settings.gpu_class is not None:
        return settings.gpu_class
    import torch

    if not torch.cuda.is_available():
        raise PluginInstallError("no CUDA GPU visible: the plugin cannot tell which GPU class's call sites SGLang "
                                 f"will use (set {dispatch.CLASS_ENV} to force one)")
    index = getattr(runner, "gpu_id", None)
    try:
        return dispatch.class_of_capability(torch.cuda.get_device_capability(index or 0))
    except dispatch.DispatchError as e:
        raise PluginInstallError(str(e)) from e


def verify_identity(backend: Any, settings: PluginSettings, gpu: str) -> None:
    """Every requested kernel's call sites on class `gpu` hold our adapter (by identity), or raise."""
    for site in sites_for(gpu, env=os.environ):
        if site.kernel not in settings.kernels:
            continue
        if site.on_backend:
            if not holds_adapter(getattr(backend, BACKEND_ATTR), site.kernel, site):
                raise PluginInstallError(f"{site.kernel}: {BACKEND_ATTR} does not hold the adapter after install")
            continue
        module = importlib.import_module(site.module)
        if not holds_adapter(getattr(module, site.attr), site.kernel, site):
            raise PluginInstallError(f"{site.kernel}: {site.module}.{site.attr} does not hold the adapter")


def kernel_owners(sites: dict[str, list[str]]) -> dict[str, str]:
    """Per kernel, "ours" when a call site holds our adapter, else "stock" (what the attestation records)."""
    return {k: "ours" if sites.get(k) else "stock" for k in KERNEL_NAMES}
