"""SIGTERM inside `up`'s own ray.init (the window where Ray's handler, which just exits, is installed): `up` must
stop what it started and say so, exit 143, as at any other moment of `up`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dsv4_cluster.orchestrator.launch.ports import port_is_free

from bench.local_cluster import write_topology
from tests.helpers import gone

pytestmark = pytest.mark.slow

# the CLI, with ray.init sending this process SIGTERM as it returns (still inside `up`'s connect), and the pid of
# the Ray head `up` starts on stderr
SIGTERM_IN_RAY_INIT = """
import os, signal, sys
from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env
prepare_ray_env(None)
import ray
real_init = ray.init
def init(*args, **kwargs):
    result = real_init(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return result
ray.init = init
from dsv4_cluster.orchestrator.cluster import ray_cluster
real_start_head = ray_cluster.start_head
def start_head(*args, **kwargs):
    address, head = real_start_head(*args, **kwargs)
    print(f"head pid {head.pid}", file=sys.stderr, flush=True)
    return address, head
ray_cluster.start_head = start_head
from dsv4_cluster.orchestrator.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_up_connects_to_ray_stops_what_up_started(tmp_path: Path) -> None:
    """Seen by a review: `up` exited 15 (Ray's handler's SystemExit; once 134, after Ray's C++ 'SIGTERM received'
    dump) without a word; here what it had started was stopped all the same (the SystemExit went through cleanup)."""
    cluster = write_topology(tmp_path)
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(cluster.home)}
    r = subprocess.run([sys.executable, "-c", SIGTERM_IN_RAY_INIT, "up", str(cluster.topology)], env=env,
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 143, r.stdout + r.stderr
    assert "up interrupted (signal SIGTERM during up); everything it started was stopped" in r.stderr, r.stderr
    assert not (cluster.home / "current.json").exists()
    head = int(r.stderr.split("head pid ")[1].split()[0])
    assert gone([head]) == []
    assert all(port_is_free(p) for p in cluster.ports.values())
