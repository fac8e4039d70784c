"""Preflight for the SGLang engine on this machine: the real problems, and the NUMA agreement rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsv4_cluster.orchestrator.cluster.record import HOME_ENV
from dsv4_cluster.orchestrator.launch.preflight import numa_mismatches, sglang_problems
from dsv4_cluster.orchestrator.topology.load import load_topology

REPO = Path(__file__).resolve().parents[2]


def test_numa_node_must_be_the_gpus_node() -> None:
    topo = load_topology(REPO / "topology.yaml")  # prefill on GPUs 0-3 / node 0, decode on 4-7 / node 1
    sysfs = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 0, 7: 1}.get
    assert numa_mismatches(topo.workers, sysfs) == [
        "decode-0: numa_node 1, but GPU 6 on node 0 (sysfs); SGLang binds each TP child to numa_node, away from "
        "its GPU — set numa_node to the GPUs' node"]
    assert numa_mismatches(topo.workers, {}.get) == []  # sysfs without a node (-1 or missing): nothing to compare


def test_the_plugin_is_installed_where_sglang_looks() -> None:
    assert sglang_problems(load_topology(REPO / "topology.yaml")) == []


def test_a_deepseek_v41_checkpoint_with_the_decode_kernel_is_refused_at_preflight(tmp_path: Path) -> None:
    """V4.1's KV rows (528 / 288 bytes) are not the 584-byte rows the decode kernel reads: refused before anything
    starts, not at the first decode call after the attestation."""
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v41", "architectures": ["DeepseekV4ForCausalLM"]}')
    topo = load_topology(REPO / "topology.yaml")
    v41 = topo.model_copy(update={"model": topo.model.model_copy(update={"path": str(tmp_path)})})
    problems = sglang_problems(v41)
    assert len(problems) == 1 and "is DeepSeek-V4.1 (config.json model_type deepseek_v41)" in problems[0]
    assert "set kernels.sparse_mla_decode: false" in problems[0]
    no_decode = v41.model_copy(update={"kernels": v41.kernels.model_copy(update={"sparse_mla_decode": False})})
    assert sglang_problems(no_decode) == []


def test_up_production_topology_stops_at_preflight_with_this_machines_problems(tmp_path: Path) -> None:
    """No 'not implemented': planning passes; what stops it is what this CPU machine lacks."""
    env = {**os.environ, HOME_ENV: str(tmp_path)}  # no other cluster's record in the way
    r = subprocess.run([sys.executable, "-m", "dsv4_cluster.orchestrator", "up", str(REPO / "topology.yaml")],
                       capture_output=True, text=True, timeout=180, env=env)  # own process: it imports Ray
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot start on this machine; nothing was started" in r.stderr
    assert "wants GPUs [0, 1, 2, 3] but this machine shows 0 CUDA device(s)" in r.stderr
    assert "not implemented" not in r.stderr
