"""GPUs read back from the NVIDIA driver per process: nvidia-smi's answers parsed (here, from its CSV), and on a GPU
machine a real worker's CUDA context found on the GPU it was given, with `status`'s mismatch when the plan differs."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.core import ClusterStatus, Role, WorkerState, WorkerStatus
from dsv4_cluster.orchestrator.readback.gpus import gpus_held, read_gpus_held
from dsv4_cluster.orchestrator.readback.pinning import pinning_report
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.cli.table import render_table

GPUS = "0, GPU-aaaa\n1, GPU-bbbb\n2, GPU-cccc\n"
APPS = "101, GPU-bbbb\n102, GPU-cccc\n103, GPU-aaaa\nNo running processes found\n"


def test_gpus_held_maps_pids_to_indices():
    assert gpus_held({101}, GPUS, APPS) == [1]
    assert gpus_held({101, 102, 999}, GPUS, APPS) == [1, 2]      # a TP server's group: every rank's GPU
    assert gpus_held({999}, GPUS, APPS) == []
    assert gpus_held({101}, GPUS, "") == [] and gpus_held({101}, "", APPS) == []


def test_the_table_shows_what_is_held_and_a_mismatch():
    w = WorkerStatus("decode-0", Role.DECODE, "local", WorkerState.READY, 7, 30200, 0, None, "/x.log",
                     pinning={"gpus_held": [1], "mismatch": ["holds CUDA contexts on GPUs [1], expected [0]"]})
    text = render_table(ClusterStatus("e", (w,)))
    assert "decode-0: holds GPU 1 (CUDA contexts, read from the NVIDIA driver)" in text
    assert "decode-0: PINNING differs from the topology: holds CUDA contexts on GPUs [1], expected [0]" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_worker_is_found_on_its_gpu(tmp_path):
    from tests.worker_procs import start_pair, stop_pair

    gpu = torch.cuda.device_count() - 1
    pair = start_pair(tmp_path, extra=["--model-preset", "flash", "--page-size", "256", "--max-total-tokens", "8192",
                                       "--context-length", "4096"],
                      prefill_extra=["--device", "cuda:0"], decode_extra=["--device", f"cuda:{gpu}"],
                      ready_timeout_s=600)
    try:
        decode_pid = pair.procs[1].pid
        assert read_gpus_held({decode_pid}) == [gpu]

        def plan(gpus):
            return LaunchPlan(name="decode-0", role=Role.DECODE, node="local", argv=(), env=(), cwd=".",
                              log_path="unused.log", port=1, health_url="http://127.0.0.1:1/health", gpus=gpus)

        assert pinning_report(plan((gpu,)), decode_pid)["mismatch"] == []
        wrong = pinning_report(plan((gpu + 1,)), decode_pid)
        assert wrong["gpus_held"] == [gpu]
        assert wrong["mismatch"] == [f"holds CUDA contexts on GPUs [{gpu}], expected [{gpu + 1}]"]
    finally:
        stop_pair(pair)
