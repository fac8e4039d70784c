"""The environment every Ray process of this tool runs with, set before `ray` is imported.

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import: without "0" a driver rewrites 127.0.0.1 to the external
address and waits forever for a GCS on loopback; with "0" it advertises 127.0.0.1, which other nodes cannot reach,
so the flag is set only for a loopback cluster.
"""

from __future__ import annotations

import os
import sys

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep nodes and drivers on 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once, no 30 s drain
    "RAY_USAGE_STATS_ENABLED": "0",
    # no idle worker processes started ahead of the first driver's tasks: every process here is an actor with its
    # own worker, so those idle ones only took memory and ~1.5 CPU-s each (16 `ray::IDLE` in one CI run of 19 heads)
    "RAY_prestart_worker_first_driver": "0",
}


class RayEnvError(RuntimeError):
    """Ray was imported before its environment was set, so it would resolve the wrong address."""


LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(address: str | None) -> bool:
    """True for "127.x.y.z:port" / "localhost:port", and for None (a local head `up` starts)."""
    if address is None:
        return True
    host = address.rpartition(":")[0] or address
    return host == "localhost" or host.startswith("127.")


def prepare_ray_env(address: str | None) -> None:
    """Put RAY_ENV into this process's environment for a driver of the cluster at `address`;
    refuse if Ray was already imported with the other loopback setting."""
    loopback = is_loopback(address)
    if "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER == loopback:
            raise RayEnvError(f"ray was imported before {LOOPBACK_ONLY} was set for {address}; "
                              "run the dsv4-cluster command in its own process")
    env = dict(RAY_ENV)
    if not loopback:
        del env[LOOPBACK_ONLY]
        os.environ.pop(LOOPBACK_ONLY, None)
    os.environ.update(env)
