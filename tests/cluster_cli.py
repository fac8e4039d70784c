"""Test helper: a whole embedded cluster brought up by the real CLI on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import openai

from dsv4_cluster.bench.local_cluster import embedded_topology

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


def next_20_succeed(c: LocalCluster) -> None:
    """The fault is over only when requests succeed: 20 greedy chats through the router, official client."""
    client = openai.OpenAI(base_url=c.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(20):
        reply = client.chat.completions.create(model="dsv4-tiny", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": f"after {i}"}],
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4, reply


def run_cli(home: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`dsv4-cluster ARGS` in its own process, with its record kept under `home`."""
    env = {**os.environ, "DSV4_CLUSTER_HOME": str(home)}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def write_topology(tmp_path: Path, context_length: int = 512, extra_decode: str = "",
                   kernels: bool = False, extra_prefill: str = "", decodes: int = 1, extra: str = "") -> LocalCluster:
    """A LocalCluster of bench.local_cluster's topology (one file for the tests and the benchmarks)."""
    path, ports = embedded_topology(tmp_path, "dsv4-test", decodes=decodes, context_length=context_length,
                                    kernels=kernels, extra_prefill=extra_prefill, extra_decode=extra_decode,
                                    extra=extra)
    return LocalCluster(home=tmp_path / "home", topology=path, ports=ports)
