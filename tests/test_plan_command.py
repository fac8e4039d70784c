"""`dsv4-cluster plan FILE`: the dry run, and the embedded capacity prediction against a live worker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from dsv4_cluster.orchestrator.capacity import embedded_bytes_per_token, predict
from dsv4_cluster.orchestrator.cli import main
from dsv4_cluster.orchestrator.plan import cluster_plans
from dsv4_cluster.orchestrator.topology import topology_from_data
from dsv4_cluster.tests.servers import free_port
from dsv4_cluster.tests.worker_procs import _wait
from dsv4_cluster.workers.kv_pool import KVPool
from dsv4_cluster.workers.model import ModelConfig
from dsv4_cluster.workers.runner import RunnerConfig

REPO = Path(__file__).resolve().parents[1]


def test_plan_prints_both_command_lines_env_and_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(REPO / "topology.yaml")]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if line.startswith("env ")]
    assert len(commands) == 3  # prefill, decode, router
    prefill, decode = commands[:2]
    assert "-m sglang.launch_server" in prefill and "--disaggregation-mode prefill" in prefill
    assert "--disaggregation-mode decode" in decode and "--base-gpu-id 4" in decode
    assert "SGLANG_HOST_IP=127.0.0.1" in decode and "DSV4_CLUSTER_KERNELS=sparse_mla_decode,indexer,topk" in decode
    assert "MAX_TOTAL_NUM_TOKENS" in out and "not predicted: SGLang 0.5.23" in out


def test_plan_of_a_broken_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(REPO / "examples" / "invalid" / "many-problems.yaml")]) == 2
    assert "9 problem(s)" in capsys.readouterr().err


def test_embedded_bytes_per_token_is_the_pools() -> None:
    for page in (4, 16, 64):
        layout = RunnerConfig(model=ModelConfig(), page_size=page, max_total_tokens=4 * page,
                              context_length=page).layout()
        assert embedded_bytes_per_token(page) == KVPool(layout).page_bytes / page


def test_embedded_prediction_equals_server_info(tmp_path: Path) -> None:
    """max_total_tokens 4100 with 16-token pages: 256 whole pages, 4096 tokens, as the worker reports."""
    port, boot = free_port(), free_port()
    topo = topology_from_data({
        "engine": "embedded", "model": {"name": "dsv4-tiny", "context_length": 1024},
        "cluster": {"run_dir": str(tmp_path)}, "kernels": {"sparse_mla_decode": False, "indexer": False,
                                                          "topk": False},
        "defaults": {"page_size": 16, "max_total_tokens": 4100},
        "prefill": [{"name": "prefill-0", "port": free_port(), "bootstrap_port": boot}],
        "decode": [{"name": "decode-0", "port": port}]}, source=tmp_path / "t.yaml")
    (_, decode), _ = cluster_plans(topo)
    predicted = predict(topo, topo.worker("decode-0"))
    assert (predicted.max_total_num_tokens, predicted.full_context_requests) == (4096, 4)
    log = tmp_path / "decode.log"
    proc = subprocess.Popen(list(decode.argv), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**decode.env_dict, "PATH": "/usr/bin:/bin"})
    try:
        _wait(decode.health_url, [proc], [log])
        info = httpx.get(decode.server_info_url, timeout=10).json()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert info["max_total_num_tokens"] == predicted.max_total_num_tokens


def test_status_shows_predicted_capacity_and_flags_a_miss_over_5_percent() -> None:
    from dsv4_cluster.orchestrator.deployment import with_predicted_capacity

    rows = [{"name": "prefill-0", "kv_capacity_tokens": 16384}, {"name": "decode-0", "kv_capacity_tokens": 15000},
            {"name": "router", "kv_capacity_tokens": None}]
    status = with_predicted_capacity({"workers": rows}, str(REPO / "examples" / "local.yaml"))
    prefill, decode, router = status["workers"]
    assert (prefill["kv_predicted_tokens"], "error" in prefill) == (16384, False)
    assert decode["error"] == "KV capacity 15000 tokens differs from the predicted 16384 by 8% (over 5%)"
    assert "kv_predicted_tokens" not in router
