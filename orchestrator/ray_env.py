"""The environment every Ray process of this tool runs with, set before `ray` is imported.

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is imported: without "0" a driver
rewrites the address 127.0.0.1 to the machine's external address and then waits forever for a
GCS that only listens on loopback. So the CLI applies this environment first and imports Ray
after; the Ray head gets the same variables.
"""

from __future__ import annotations

import os
import sys

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep nodes and drivers on 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once, no 30 s drain
    "RAY_USAGE_STATS_ENABLED": "0",
}


class RayEnvError(RuntimeError):
    """Ray was imported before its environment was set, so it would resolve the wrong address."""


def prepare_ray_env() -> None:
    """Put RAY_ENV into this process's environment; refuse if Ray already read a different one."""
    if "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RayEnvError("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; "
                              "run the dsv4-cluster command in its own process, or export "
                              "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    os.environ.update(RAY_ENV)
