"""Every test process is a driver of loopback Ray clusters only: set Ray's environment before any test
module imports `ray` (Ray reads it once, at import; `orchestrator/cluster/ray_env.py` says why)."""

from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env

prepare_ray_env(None)
