"""`up`'s preflight (orchestrator/launch/preflight.py): a problem it names stops `up` before any process starts; for
the SGLang engine, this machine's real problems and the NUMA agreement rule (none of these tests needs SGLang
installed: the plugin is looked for among this project's entry points, and SGLang's absence is one more problem)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.local_cluster import run_cli, write_topology
from dsv4_cluster.orchestrator.cluster.record import HOME_ENV
from dsv4_cluster.orchestrator.launch.preflight import numa_mismatches, sglang_problems
from dsv4_cluster.orchestrator.topology.load import load_topology

REPO = Path(__file__).resolve().parents[2]


def test_a_run_dir_up_cannot_create_is_named_and_nothing_starts(tmp_path: Path) -> None:
    """Seen by a review: `cluster.run_dir` under a file made `up` die with a traceback as it started the Ray head."""
    cluster = write_topology(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder\n")
    cluster.topology.write_text(cluster.topology.read_text().replace("run_dir: run", "run_dir: taken/run"))
    r = run_cli(cluster.home, "up", str(cluster.topology), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "nothing was started" in r.stderr and f"cluster.run_dir {tmp_path / 'taken' / 'run'}: cannot create" \
        in r.stderr, r.stderr
    assert not (cluster.home / "current.json").exists()


def test_the_run_dir_check_makes_no_folder_and_names_a_dangling_logs_link(tmp_path: Path) -> None:
    """The check leaves nothing behind (a failed preflight left an empty `<run_dir>/logs`); a `logs` that is a link to
    nothing is named here, not a FileExistsError once the head's start makes the folder."""
    from types import SimpleNamespace

    from dsv4_cluster.orchestrator.launch.preflight import run_dir_problems

    run = tmp_path / "run"
    assert run_dir_problems(SimpleNamespace(run_dir_path=str(run))) == [] and not run.exists()
    run.mkdir()
    (run / "logs").symlink_to(tmp_path / "nowhere")
    assert run_dir_problems(SimpleNamespace(run_dir_path=str(run))) == [
        f"cluster.run_dir {run}: cannot create {run / 'logs'} ({run / 'logs'} is not a folder) — pick a folder this "
        "user can write"]


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
