"""Test helper: a whole embedded cluster brought up by the real CLI on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsv4_cluster.orchestrator.ports import free_ports

CLI = [sys.executable, "-m", "dsv4_cluster.orchestrator"]


@dataclass(frozen=True)
class LocalCluster:
    home: Path
    topology: Path
    ports: dict[str, int]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return run_cli(self.home, *args, timeout=timeout)

    @contextlib.contextmanager
    def running(self) -> Iterator[LocalCluster]:
        """`up` this cluster (asserting it succeeded), and `down` it afterwards (asserting that too)."""
        up = self.cli("up", str(self.topology), "--timeout", "180")
        try:
            assert up.returncode == 0, up.stderr + up.stdout
            yield self
        finally:
            down = self.cli("down", "--timeout", "10")
            assert down.returncode == 0, down.stderr + down.stdout


def run_cli(home: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`dsv4-cluster ARGS` in its own process, with its record kept under `home`."""
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(home)}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def write_topology(tmp_path: Path, context_length: int = 512, extra_decode: str = "",
                   kernels: bool = False, extra_prefill: str = "") -> LocalCluster:
    router, prefill, boot, decode = free_ports(4)
    k = "true" if kernels else "false"
    path = tmp_path / "topology.yaml"
    path.write_text(f"""
engine: embedded
model: {{name: dsv4-tiny, seed: 0, context_length: {context_length}}}
cluster: {{namespace: dsv4-test-{router}, run_dir: run}}
router: {{host: 127.0.0.1, port: {router}}}
kernels: {{sparse_mla_decode: {k}, indexer: {k}, topk: {k}}}
defaults: {{page_size: 16, kv_cache_dtype: auto, max_total_tokens: 4096}}
prefill:
  - {{name: prefill-0, device: cpu, port: {prefill}, bootstrap_port: {boot}{extra_prefill}}}
decode:
  - {{name: decode-0, device: cpu, port: {decode}{extra_decode}}}
""")
    ports = {"router": router, "prefill": prefill, "bootstrap": boot, "decode": decode}
    return LocalCluster(home=tmp_path / "home", topology=path, ports=ports)
