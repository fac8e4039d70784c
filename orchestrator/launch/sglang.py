"""The SGLang launch spec: `launch_server` flags and environment as SGLang 0.5.23 resolves them.

Why each flag is what it is (page size 256, KV dtype names, SGLANG_HOST_IP, all GPUs visible with
`--base-gpu-id`, `--numa-node` and no numactl, `--enable-cache-report`, the plugin's env): docs/sglang.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_cluster.core import Role
from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, WORKER_ENV

if TYPE_CHECKING:
    from dsv4_cluster.orchestrator.topology.schema import Topology, WorkerConfig

from dsv4_cluster.orchestrator.launch.sglang_facts import (
    SGLANG_KV_DTYPE, SGLANG_REASONING_PARSER, SGLANG_TOOL_CALL_PARSER)


def attest_dir(topology: Topology, worker: WorkerConfig) -> Path:
    """Where the TP ranks of `worker` write their attestations (under the run folder)."""
    return Path(topology.run_dir_path) / "attest" / worker.name


def numa_node_list(worker: WorkerConfig) -> list[str]:
    """`--numa-node` as SGLang indexes it: by GPU id, so it covers ids 0..max(gpus)."""
    if worker.numa_node is None or not worker.gpus:
        return []
    return [str(worker.numa_node)] * (max(worker.gpus) + 1)


def sglang_argv(topology: Topology, worker: WorkerConfig) -> list[str]:
    """SGLang 0.5.23 `launch_server` argv (the kernels travel in the env); parsed by SGLang in tests."""
    role = worker.role.value
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(topology.model.path),
        "--served-model-name", topology.model.name,
        "--tp-size", str(worker.tp),
        "--base-gpu-id", str(min(worker.gpus) if worker.gpus else 0),
        "--gpu-id-step", "1",
        "--host", topology.node(worker.node).address,   # never 0.0.0.0: workers have no auth of their own
        "--port", str(worker.port),
        "--nccl-port", str(worker.nccl_port),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", topology.transfer.backend,
    ]
    if role == Role.PREFILL.value:
        argv += ["--disaggregation-bootstrap-port", str(worker.bootstrap_port)]
    argv += [
        "--page-size", str(worker.page_size),  # 256: the rules refuse any other for engine sglang
        "--kv-cache-dtype", SGLANG_KV_DTYPE[str(worker.kv_cache_dtype)],
        "--context-length", str(topology.model.context_length),
        "--random-seed", str(topology.model.seed),
    ]
    if worker.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(worker.max_total_tokens)]
    numa = numa_node_list(worker)
    if numa:
        argv += ["--numa-node", *numa]
    argv += [
        "--enable-metrics",
        "--enable-cache-report",   # usage.prompt_tokens_details.cached_tokens (the prefill's hit, on a decode)
        "--trust-remote-code",
        "--reasoning-parser", SGLANG_REASONING_PARSER,
        "--tool-call-parser", SGLANG_TOOL_CALL_PARSER,
    ]
    return argv + [str(a) for a in worker.extra_args]


def sglang_env(topology: Topology, worker: WorkerConfig, kernels: tuple[str, ...]) -> dict[str, str]:
    """The environment an SGLang worker needs beyond the common one (no CUDA_VISIBLE_DEVICES)."""
    env = {"SGLANG_HOST_IP": topology.node(worker.node).address}
    if kernels:
        env[KERNELS_ENV] = ",".join(kernels)
        env[ATTEST_DIR_ENV] = str(attest_dir(topology, worker))
        env[WORKER_ENV] = worker.name
    return env
