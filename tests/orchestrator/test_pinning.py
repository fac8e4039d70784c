"""Pinning read back from real processes (/proc), and the mismatch flags `status` shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.readback.pinning import format_cpu_list, parse_cpu_list, pinning_report
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from tests.helpers import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _plan(argv: list[str], env: dict[str, str]) -> LaunchPlan:
    return LaunchPlan(name="decode-p", role=Role.DECODE, node="local", argv=tuple(argv), env=tuple(env.items()),
                      cwd=".", log_path="unused.log", port=1, health_url="http://127.0.0.1:1/health")


def _spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start `argv` and wait until the sleeper itself runs (numactl execs it after pinning)."""
    proc = subprocess.Popen(argv, env={**os.environ, **env})
    wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] == sys.executable.encode(), 30,
             "numactl to exec the sleeper", interval_s=0.01)
    return proc


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_a_process_not_run_as_planned_is_flagged():
    """The plan asks for NUMA node 0 and GPU 3; the process was started without numactl, sees GPU 5,
    and has its affinity narrowed afterwards: each difference is named."""
    proc = _spawn(SLEEPER, {"CUDA_VISIBLE_DEVICES": "5"})
    try:
        os.sched_setaffinity(proc.pid, {0})
        report = pinning_report(_plan(["numactl", "--cpunodebind=0", "--membind=0", *SLEEPER],
                                      {"CUDA_VISIBLE_DEVICES": "3"}), proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert (report["cpus"], report["visible_gpus"]) == ("0", "5")
    text = "; ".join(report["mismatch"])
    assert "sees GPUs '5', expected '3'" in text
    assert "memory policy default, expected bind:0" in text
    node0 = Path("/sys/devices/system/node/node0/cpulist").read_text().strip()
    if parse_cpu_list(node0) != {0}:
        assert f"NUMA node 0 has {format_cpu_list(parse_cpu_list(node0))}" in text


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl is not installed")
def test_a_process_run_as_planned_matches():
    argv = ["numactl", "--cpunodebind=0", "--membind=0", *SLEEPER]
    proc = _spawn(argv, {"CUDA_VISIBLE_DEVICES": "3"})
    try:
        report = pinning_report(_plan(argv, {"CUDA_VISIBLE_DEVICES": "3"}), proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert report["numa_policy"] == "bind:0" and report["mems_allowed"] == "0"
    assert report["mismatch"] == [], report
