"""`verify`'s judgements: per-rank kernel attestations and counters, the answer check, the speed probe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI

from dsv4_cluster.kernels.sglang_plugin.attestation import Attestation, write_attestation
from dsv4_cluster.kernels.sglang_plugin.settings import SGLANG_VERSION
from dsv4_cluster.orchestrator.verify.answer_set import ANSWERS
from dsv4_cluster.orchestrator.verify.kernels import attestation_problems, counter_problems
from dsv4_cluster.orchestrator.verify.serving import (
    check_answers, compare_with_last_good, first_integer, store_last_good)
from tests.servers import UvicornThread

KERNELS = ("sparse_mla_decode", "indexer", "topk")
SITES = {"sparse_mla_decode": ["DeepseekV4AttnBackend._flash_mla_with_kvcache"],
         "indexer": ["deep_gemm.fp8_paged_mqa_logits"],
         "topk": ["sglang.kernels.ops.attention.dsv4.topk.topk_transform_paged_v2"]}


@pytest.fixture
def server_group():
    """A real 'server' process group: a leader and two children, like launch_server and its TP ranks."""
    code = ("import subprocess, sys, time; "
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]; "
            "print(' '.join(str(k.pid) for k in kids), flush=True); time.sleep(60)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    kids = [int(p) for p in leader.stdout.readline().split()]
    yield leader.pid, [leader.pid, *kids]
    os.killpg(leader.pid, 9)
    leader.wait(timeout=10)


def _attest(folder: Path, rank: int, pid: int, sites: dict | None = None) -> None:
    write_attestation(folder, Attestation(worker="decode-0", rank=rank, pid=pid, gpu=rank,
                                          sglang_version=SGLANG_VERSION, project_version="0.1.0",
                                          call_sites=SITES if sites is None else sites))


def test_every_rank_attests_from_the_live_server(tmp_path: Path, server_group) -> None:
    leader, pids = server_group
    for rank, pid in enumerate(pids):
        _attest(tmp_path, rank, pid)
    assert attestation_problems("decode-0", tmp_path, 3, KERNELS, leader) == []


def test_a_rank_installed_for_another_gpu_class_or_running_stock_is_named(tmp_path: Path, server_group) -> None:
    """`verify` expects what the dispatch table says for the GPUs it finds: the class each rank installed for must
    be its GPUs' class (else it replaced call sites SGLang does not call there), and every kernel ours."""
    leader, pids = server_group
    owners = dict.fromkeys(KERNELS, "ours")
    for rank, pid in enumerate(pids):
        write_attestation(tmp_path, Attestation(
            worker="decode-0", rank=rank, pid=pid, gpu=rank, sglang_version=SGLANG_VERSION, project_version="0.1.0",
            call_sites=SITES, gpu_class="sm_120" if rank == 1 else "sm_90",
            kernels={**owners, "indexer": "stock"} if rank == 2 else owners))
    assert attestation_problems("decode-0", tmp_path, 3, KERNELS, leader) == [
        "decode-0: rank 2: kernel indexer runs stock on sm_90, where the dispatch table runs ours"]
    assert attestation_problems("decode-0", tmp_path, 3, KERNELS, leader, "sm_90") == [
        "decode-0: rank 1 installed for GPU class sm_120, but its GPUs are sm_90: the call sites it replaced are "
        "not the ones SGLang calls there",
        "decode-0: rank 2: kernel indexer runs stock on sm_90, where the dispatch table runs ours"]


def test_a_missing_rank_is_named(tmp_path: Path, server_group) -> None:
    leader, pids = server_group
    _attest(tmp_path, 0, pids[0])
    _attest(tmp_path, 2, pids[2])
    problems = attestation_problems("decode-0", tmp_path, 3, KERNELS, leader)
    assert len(problems) == 1 and problems[0].startswith("decode-0: rank 1 wrote no attestation")


def test_a_kernel_that_could_not_be_installed_is_named(tmp_path: Path, server_group) -> None:
    leader, pids = server_group
    for rank, pid in enumerate(pids):
        _attest(tmp_path, rank, pid, {k: v for k, v in SITES.items() if (k, rank) != ("indexer", 1)})
    assert attestation_problems("decode-0", tmp_path, 3, KERNELS, leader) == [
        "decode-0: rank 1: kernel indexer was requested but no call site holds it"]


def test_a_stale_attestation_from_a_previous_run_does_not_count(tmp_path: Path, server_group) -> None:
    leader, pids = server_group
    _attest(tmp_path, 0, pids[0])
    _attest(tmp_path, 1, 999_999_999)  # a pid from a run that is gone
    problems = attestation_problems("decode-0", tmp_path, 2, KERNELS, leader)
    assert problems == [f"decode-0: rank 1's attestation is from pid 999999999, which is not a live process "
                        f"of the supervised server (pid {leader})"]


def test_counters_must_rise_on_every_decode_rank() -> None:
    before = {0: {"sparse_mla_decode": 10, "indexer": 4, "topk": 4}, 1: {"sparse_mla_decode": 10}}
    after = {0: {"sparse_mla_decode": 60, "indexer": 30, "topk": 30},
             1: {"sparse_mla_decode": 60, "indexer": 26, "topk": 0}}
    assert counter_problems("decode-0", 2, KERNELS, before, after) == [
        "decode-0: rank 1: kernel topk was not called during the decode steps (counter 0 -> 0); "
        "the stock kernel ran instead"]
    assert counter_problems("decode-0", 3, ("indexer",), before, after) == [
        "decode-0: rank 2 publishes no kernel counters"]


def _answering(wrong_every: int) -> FastAPI:
    """A chat endpoint that answers the shipped questions, wrong on every `wrong_every`-th."""
    app, truth, seen = FastAPI(), dict(ANSWERS), []

    @app.post("/v1/chat/completions")
    def chat(body: dict) -> dict:
        prompt = body["messages"][0]["content"]
        seen.append(prompt)
        answer = truth[prompt] + (1 if len(seen) % wrong_every == 0 else 0)
        return {"choices": [{"message": {"role": "assistant", "content": f"{answer:,}"}}],
                "usage": {"completion_tokens": 3}}

    return app


def test_answer_check_fails_on_an_endpoint_that_answers_wrong() -> None:
    with UvicornThread(_answering(wrong_every=2)) as server:
        report = check_answers(f"{server.url}/v1", "DeepSeek-V4-Flash")
    assert (report.passed, report.total, report.ok) == (10, 20, False)
    assert "expected 571, got '572'" in report.summary()


def test_answer_check_passes_at_the_documented_rate() -> None:
    with UvicornThread(_answering(wrong_every=10)) as server:  # 18 of 20 right: exactly PASS_RATE
        report = check_answers(f"{server.url}/v1", "DeepSeek-V4-Flash")
    assert (report.passed, report.ok) == (18, True)


def test_first_integer_reads_formatted_numbers() -> None:
    assert (first_integer("2,232"), first_integer("The answer is 391."), first_integer("none")) == (2232, 391, None)


def test_throughput_drop_is_flagged_against_the_last_good_run(tmp_path: Path) -> None:
    assert compare_with_last_good(tmp_path, 100.0) is None  # nothing stored yet
    store_last_good(tmp_path, 100.0)
    assert compare_with_last_good(tmp_path, 60.0) is None
    assert "40% of the last good run (100.0 tok/s" in compare_with_last_good(tmp_path, 40.0)


def test_verify_kernels_of_the_production_plan_reads_every_ranks_attestation(tmp_path: Path, server_group) -> None:
    """What `up` and `verify` call: SGLang workers are judged by their ranks' attestations (tp 4 each)."""
    from dsv4_cluster.orchestrator.launch.plan import cluster_plans, requested_kernels
    from dsv4_cluster.orchestrator.topology.load import load_topology
    from dsv4_cluster.orchestrator.verify.sequence import verify_kernels

    topo = load_topology(Path(__file__).resolve().parents[2] / "topology.yaml")
    topo.cluster.run_dir = str(tmp_path)
    workers, _ = cluster_plans(topo)
    leader, pids = server_group
    for plan in workers:
        for rank in range(4):
            if (plan.name, rank) != ("decode-0", 3):
                _attest(tmp_path / "attest" / plan.name, rank, pids[rank % len(pids)])
    problems = verify_kernels(tuple(workers), requested_kernels(topo), {"prefill-0": leader, "decode-0": leader})
    assert len(problems) == 1 and problems[0].startswith("decode-0: rank 3 wrote no attestation")
    assert "sparse_mla_decode, indexer, topk are not proven there" in problems[0]


def test_status_reports_sglang_kernels_only_when_every_rank_attests(tmp_path: Path, server_group) -> None:
    from dsv4_cluster.orchestrator.verify.kernels import attested_kernels
    from dsv4_cluster.orchestrator.launch.plan import cluster_plans
    from dsv4_cluster.orchestrator.topology.load import load_topology

    topo = load_topology(Path(__file__).resolve().parents[2] / "topology.yaml")
    topo.cluster.run_dir = str(tmp_path)
    (_, decode), _ = cluster_plans(topo)
    leader, pids = server_group
    for rank in range(3):
        _attest(tmp_path / "attest" / "decode-0", rank, pids[rank])
    assert dict(attested_kernels(decode, leader)) == dict.fromkeys(KERNELS, "unproven")  # rank 3 missing
    _attest(tmp_path / "attest" / "decode-0", 3, pids[0])
    assert dict(attested_kernels(decode, leader)) == dict.fromkeys(KERNELS, "dsv4-cluster")


def test_a_failed_verify_says_why_even_without_notes() -> None:
    """A verify that failed before any step passed printed "NOT verified: " with nothing after it."""
    from dsv4_cluster.orchestrator.verify.sequence import VerifyReport

    failed = VerifyReport(problems=["throughput probe failed: connection refused"]).summary()
    assert failed.splitlines() == ["NOT verified (1 problem(s) below)",
                                   "problem: throughput probe failed: connection refused"]
    noted = VerifyReport(problems=["p"], notes=["PD check passed"]).summary()
    assert noted.splitlines()[0] == "NOT verified (1 problem(s) below): PD check passed"
    assert VerifyReport(notes=["throughput 9.0 tok/s"]).summary() == "verified: throughput 9.0 tok/s"
