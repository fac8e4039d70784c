"""`dsv4-cluster plan FILE`: the dry run, and the embedded capacity prediction against a live worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.launch import sglang_capacity as sg
from dsv4_cluster.orchestrator.launch.capacity import embedded_bytes_per_token, predict, predict_sglang
from dsv4_cluster.orchestrator.cli.main import main
from dsv4_cluster.orchestrator.launch.plan import cluster_plans
from dsv4_cluster.orchestrator.topology.load import load_topology, topology_from_data
from tests.servers import free_ports
from tests.worker_procs import _wait
from dsv4_cluster.workers.kv.pool import KVPool
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.runner import RunnerConfig

REPO = Path(__file__).resolve().parents[2]


def test_plan_prints_both_command_lines_env_and_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(REPO / "topology.yaml")]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if line.startswith("env ")]
    assert len(commands) == 3  # prefill, decode, router
    prefill, decode = commands[:2]
    assert "-m sglang.launch_server" in prefill and "--disaggregation-mode prefill" in prefill
    assert "--disaggregation-mode decode" in decode and "--base-gpu-id 4" in decode
    assert "SGLANG_HOST_IP=127.0.0.1" in decode and "DSV4_CLUSTER_KERNELS=sparse_mla_decode,indexer,topk" in decode
    table = out[out.index("SERVER "):].splitlines()
    assert table[0].split() == ["SERVER", "ENGINE", "MEM_FRACTION", "MAX_TOTAL_NUM_TOKENS", "FULL_CONTEXT_REQS",
                                "KV_BYTES/TOKEN", "FREE_GIB/GPU", "NOTE"]
    used = [line.split() for line in table[1:] if "*" in line.split()[2:3][0]]
    # SGLang's default fractions on an H200 (prefill 0.907, decode 0.929; test_sglang_capacity checks them
    # and the token counts against SGLang's own code), 131072-token context, 7086.75 KV bytes per token.
    assert [r[:6] for r in used] == [["prefill-0", "sglang", "0.907*", "13100800", "99", "7087"],
                                     ["decode-0", "sglang", "0.929*", "13564928", "103", "7087"]]
    assert len(table) == 1 + 12 + 1 and table[-1].startswith("SGLang 0.5.23 DeepSeek-V4 sizing: GPU 143771 MiB")


def test_plan_takes_the_gpu_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    """An 80 GiB GPU with a smaller checkpoint: other fractions, other sizes (all still SGLang's rule)."""
    assert main(["plan", str(REPO / "topology.yaml"), "--gpu-mib", "81559", "--checkpoint-gib", "90",
                 "--free-before-load-gib", "78.5"]) == 0
    out = capsys.readouterr().out
    used = [line.split()[:4] for line in out.splitlines() if line.startswith(("prefill-0 ", "decode-0 "))
            and "*" in line.split()[2]]
    assert used[0][2] == f"{sg.default_mem_fraction(81559, Role.PREFILL, 4):.3f}*"
    pool = sg.size_pool(sg.DSV4_FLASH, available=sg.available_bytes(78.5, 22.5, 0.8),
                        mem_fraction=0.8)
    assert ["decode-0", "sglang", "0.800", str(pool.max_total_num_tokens)] in \
        [line.split()[:4] for line in out.splitlines()]
    assert "free before load 78.5 GiB, weights per GPU TP4 22.5 GiB" in out


def _sglang_topology(tmp_path: Path, **decode: object):
    data = yaml.safe_load((REPO / "topology.yaml").read_text())
    data["decode"][0].update(decode)
    return topology_from_data(data, source=tmp_path / "t.yaml")


def test_sglang_prediction_follows_extra_args_and_names_what_it_cannot(tmp_path: Path) -> None:
    topo = _sglang_topology(tmp_path, extra_args=["--mem-fraction-static", "0.85"])
    assert predict(topo, topo.worker("decode-0")).mem_fraction == 0.85
    topo = _sglang_topology(tmp_path, extra_args=["--max-running-requests=64", "--enable-hisparse"])
    row = predict(topo, topo.worker("decode-0"))
    assert row.max_total_num_tokens is None
    assert row.note == ("not predicted: extra_args --max-running-requests, --enable-hisparse change SGLang's "
                        "sizing in ways not followed here")
    topo = _sglang_topology(tmp_path, max_total_tokens=1_000_000)
    assert predict(topo, topo.worker("decode-0")).max_total_num_tokens == 1_000_000 // 256 * 256


def test_sglang_sizing_refuses_other_versions_and_too_small_fractions() -> None:
    with pytest.raises(sg.SizingError, match="SGLang 0.5.23's; SGLang 0.5.14 sizes it differently"):
        sg.size_pool(sg.DSV4_FLASH, available=80 << 30, mem_fraction=0.9,
                     sglang_version="0.5.14")
    with pytest.raises(sg.SizingError, match="leaves no memory for the KV cache after 130.0 GiB of weights "
                                             "per GPU; it must exceed 0.933"):
        sg.available_bytes(139.4, 130.0, 0.9)
    topo = load_topology(REPO / "topology.yaml")
    row = predict_sglang(topo, topo.worker("decode-0"), sglang_version="0.5.24")
    assert row.max_total_num_tokens is None and row.note.startswith("not predicted: the DeepSeek-V4 pool sizing")


def test_shipped_geometry_is_the_committed_deepseek_v4_flash_config() -> None:
    config = json.loads((REPO / "tests" / "data" / "deepseek-v4-flash" / "config.json").read_text())
    assert sg.DSV4Geometry.from_config(config) == sg.DSV4_FLASH
    assert sg.geometry_for(str(REPO / "tests" / "data" / "deepseek-v4-flash")) == sg.DSV4_FLASH
    assert (sg.DSV4_FLASH.layers(0), sg.DSV4_FLASH.layers(4), sg.DSV4_FLASH.layers(128)) == (2, 21, 20)


def test_plan_of_a_broken_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(REPO / "examples" / "invalid" / "many-problems.yaml")]) == 2
    assert "10 problem(s)" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback() -> None:
    """`dsv4-cluster plan FILE | head -1`: the pipe closes before the output is written."""
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.orchestrator", "plan", str(REPO / "topology.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the command has imported enough to print
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_embedded_bytes_per_token_is_the_pools() -> None:
    for page in (4, 16, 64):
        layout = RunnerConfig(model=ModelConfig(), page_size=page, max_total_tokens=4 * page,
                              context_length=page).layout()
        assert embedded_bytes_per_token() == KVPool(layout).page_bytes / page


def test_embedded_bytes_per_token_follow_the_preset_and_device() -> None:
    """The flash preset's pool on cuda (auto: SGLang's fp8 layout; bf16 rows), as the engine allocates it (meta
    tensors: no memory), at SGLang's 256-token pages and at 128."""
    import torch

    from dsv4_cluster.workers.engine.presets import model_config

    flash = model_config("flash")
    for page in (128, 256):
        for dtype in ("auto", "bf16"):
            layout = RunnerConfig(model=flash, page_size=page, max_total_tokens=4 * page, context_length=page,
                                  device="cuda", kv_dtype=dtype).layout()
            pool = KVPool(layout, device="meta", dtype=torch.bfloat16)
            assert layout.dtype == ("fp8_e4m3" if dtype == "auto" else "bfloat16")
            assert embedded_bytes_per_token("flash", "cuda", dtype, page) == pool.page_bytes / page
    assert embedded_bytes_per_token("flash", "cuda", "auto", 256) == 2712     # 584-B rows + padding + keys
    assert embedded_bytes_per_token("flash", "cuda") != embedded_bytes_per_token()


def test_embedded_prediction_equals_server_info(tmp_path: Path) -> None:
    """max_total_tokens 4100 with 16-token pages: 256 whole pages, 4096 tokens, as the worker reports."""
    port, boot, prefill_port = free_ports(3)
    topo = topology_from_data({
        "engine": "embedded", "model": {"name": "dsv4-tiny", "context_length": 1024},
        "cluster": {"run_dir": str(tmp_path)}, "kernels": {"sparse_mla_decode": False, "indexer": False,
                                                          "topk": False},
        "defaults": {"page_size": 16, "max_total_tokens": 4100},
        "prefill": [{"name": "prefill-0", "port": prefill_port, "bootstrap_port": boot}],
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
    from dsv4_cluster.core import KvUsage, Role, WorkerState, WorkerStatus
    from dsv4_cluster.orchestrator.supervise.status_endpoint import predicted_capacity, with_predicted_capacity

    def row(name: str, capacity: int | None) -> WorkerStatus:
        return WorkerStatus(name, Role(name.split("-")[0]), "local", WorkerState.READY, 1, 1, 0,
                            KvUsage(capacity, 0) if capacity else None, "/x.log")

    predicted = predicted_capacity(load_topology(REPO / "examples" / "local.yaml"))
    prefill, decode, router = (with_predicted_capacity(r, predicted) for r in
                               (row("prefill-0", 16384), row("decode-0", 15000), row("router", None)))
    assert (prefill.kv_predicted_tokens, prefill.error) == (16384, None)
    assert decode.error == "KV capacity 15000 tokens differs from the predicted 16384 by 8% (over 5%)"
    assert router.kv_predicted_tokens is None


@pytest.mark.parametrize("topology", ["topology.yaml", "examples/local.yaml"])
def test_plan_and_install_service_import_neither_torch_nor_ray(topology: str, tmp_path: Path) -> None:
    """The commands that only read a topology answer in well under a second: torch's import alone takes seconds (the
    embedded presets and the KV layouts they check are torch-free: `kv/layout.py`, `engine/config.py`)."""
    code = ("import contextlib, io, sys\n"
            "from dsv4_cluster.orchestrator.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    codes = [main(['plan', {str(REPO / topology)!r}]),\n"
            f"             main(['install-service', {str(REPO / topology)!r}, '--dry-run'])]\n"
            "print(codes, sorted({'torch', 'ray'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DSV4_CLUSTER_HOME": str(tmp_path)})
    assert out.stdout.strip() == "[0, 0] []", out.stdout + out.stderr
