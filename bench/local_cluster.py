"""The embedded cluster the benchmarks and the end-to-end tests bring up: one topology file on free
loopback ports (1 prefill, N decode, CPU), so that no two runs on one machine collide, brought up and
down by the real CLI in its own process (`LocalCluster`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsv4_cluster.orchestrator.launch.ports import free_ports


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


def status_rows(home: Path) -> dict[str, dict]:
    """`dsv4-cluster status --json`'s rows by process name (pid, state, restarts, log path, ...)."""
    st = run_cli(home, "status", "--json", timeout=300)
    if st.returncode != 0:
        raise RuntimeError(f"status failed: {st.stderr}")
    return {w["name"]: w for w in json.loads(st.stdout)["workers"]}


def write_topology(folder: Path, context_length: int = 512, extra_decode: str = "", kernels: bool = False,
                   extra_prefill: str = "", decodes: int = 1, extra: str = "", namespace: str = "dsv4-test") -> LocalCluster:
    """`folder/topology.yaml` on free ports (1 prefill, `decodes` decode, CPU) and its LocalCluster; the ports are
    router, prefill, bootstrap, decode-<i> (and decode, the first decode's). `extra_prefill`/`extra_decode` continue
    each worker's flow mapping (", key: value"); `extra` is appended as top-level YAML (e.g. a `transfer:` section)."""
    router, prefill, boot, *decode_ports = free_ports(3 + decodes)
    k = "true" if kernels else "false"
    decode_lines = "".join(f"  - {{name: decode-{i}, device: cpu, port: {port}{extra_decode}}}\n"
                           for i, port in enumerate(decode_ports))
    path = folder / "topology.yaml"
    path.write_text(f"""
engine: embedded
model: {{name: dsv4-tiny, seed: 0, context_length: {context_length}}}
cluster: {{namespace: {namespace}-{router}, run_dir: run}}
router: {{host: 127.0.0.1, port: {router}}}
kernels: {{sparse_mla_decode: {k}, indexer: {k}, topk: {k}}}
defaults: {{page_size: 16, kv_cache_dtype: auto, max_total_tokens: 4096}}
prefill:
  - {{name: prefill-0, device: cpu, port: {prefill}, bootstrap_port: {boot}{extra_prefill}}}
decode:
{decode_lines}{extra}""")
    ports = {"router": router, "prefill": prefill, "bootstrap": boot, "decode": decode_ports[0],
             **{f"decode-{i}": port for i, port in enumerate(decode_ports)}}
    return LocalCluster(home=folder / "home", topology=path, ports=ports)
