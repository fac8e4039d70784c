"""What the supervisor tells the plugin, by environment, and what the plugin may be asked for.

The plugin runs inside SGLang's processes (entry point group `sglang.srt.plugins`), so the only
channel from the orchestrator is the environment the supervisor gives `launch_server`, which
SGLang's `spawn`ed TP children inherit. Without `KERNELS_ENV` the plugin does nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsv4_cluster.core import KERNEL_NAMES
from dsv4_cluster.kernels.dispatch import DispatchError, forced_class

KERNELS_ENV = "DSV4_CLUSTER_KERNELS"  # comma-separated kernel names; unset or empty: inert
ATTEST_DIR_ENV = "DSV4_CLUSTER_ATTEST_DIR"  # folder where each TP rank writes its attestation
WORKER_ENV = "DSV4_CLUSTER_WORKER"  # the worker's name, written into every attestation
# CLASS_ENV (kernels/dispatch.py): force the GPU class whose call sites are replaced
SGLANG_VERSION = "0.5.23"  # the release whose call sites the plugin knows; any other fails closed


class PluginSettingsError(ValueError):
    """The environment asks the plugin for something it does not know."""


@dataclass(frozen=True)
class PluginSettings:
    kernels: tuple[str, ...]
    attest_dir: str | None
    worker: str | None
    gpu_class: str | None = None  # forced by CLASS_ENV (tests, stand-ins); None: read from the GPU

    @property
    def active(self) -> bool:
        return bool(self.kernels)


def settings_from_env(env: dict[str, str] | None = None) -> PluginSettings:
    """The plugin's settings from `env` (default: this process's environment)."""
    env = dict(os.environ) if env is None else env
    names = tuple(k.strip() for k in env.get(KERNELS_ENV, "").split(",") if k.strip())
    unknown = [k for k in names if k not in KERNEL_NAMES]
    if unknown:
        raise PluginSettingsError(f"{KERNELS_ENV} names unknown kernel(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(KERNEL_NAMES)}")
    attest = env.get(ATTEST_DIR_ENV) or None
    if names and attest is None:
        raise PluginSettingsError(f"{KERNELS_ENV} is set but {ATTEST_DIR_ENV} is not: the plugin "
                                  "must write each rank's attestation somewhere")
    try:
        gpu = forced_class(env)
    except DispatchError as e:
        raise PluginSettingsError(str(e)) from e
    return PluginSettings(kernels=names, attest_dir=attest, worker=env.get(WORKER_ENV) or None, gpu_class=gpu)
