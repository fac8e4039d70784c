"""What runs where by GPU class (orchestrator/launch/gpu_classes.py): the driver's answer read, `plan`'s table
from the one dispatch table and SGLang's call sites, and preflight refusing kernels a class cannot take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4_cluster.orchestrator.launch import gpu_classes as gc
from dsv4_cluster.orchestrator.topology.load import load_topology

ROOT = Path(__file__).resolve().parents[2]


def test_the_drivers_compute_capabilities_map_to_sglangs_classes():
    assert gc.classes_from_smi("0, 9.0\n1, 12.0\n2, 10.0\n3, 8.0\n") == {0: "sm_90", 1: "sm_120", 2: "sm_100",
                                                                         3: None}
    with pytest.raises(gc.GpuClassError, match="not 'index, compute_cap'"):
        gc.classes_from_smi("0, [N/A]")


def test_detect_asks_nvidia_smi_and_reads_no_driver_as_unknown():
    seen = []

    def run(argv, **kw):
        seen.append(argv)
        return SimpleNamespace(returncode=0, stdout="0, 9.0\n1, 9.0\n")

    assert gc.detect_classes(run) == {0: "sm_90", 1: "sm_90"}
    assert seen[0][:2] == ["nvidia-smi", "--query-gpu=index,compute_cap"]
    assert gc.detect_classes(lambda argv, **kw: SimpleNamespace(returncode=9, stdout="")) is None


@pytest.mark.parametrize("gpu,decode,site", [
    ("sm_90", "routed (16 real heads at TP4): ours at window B=1,8,32,64,128,256; c4 B=1,8,32,64,128,256; "
               "c128 B=1,8,32,64,128,256; else stock",
     "flash_mla_interface.flash_mla_with_kvcache, metadata_kernel._init_compressed_attn_metadata_triton, "
     "attn_metadata_kernels.build_page_table_positions_triton"),
    ("sm_100", "routed (16 real heads at TP4): stock on every call", "flash_mla_interface.flash_mla_with_kvcache; not ours: "
               "decode_attention_sm100.swapab_attention, DeepseekV4TrtllmAttnBackend._forward_trtllm (opt-in)"),
    ("sm_120", "routed (16 real heads at TP4): ours on every call", "flash_mla_sm120.flash_mla_with_kvcache_sm120"),
])
def test_the_production_topologys_kernels_by_class(gpu, decode, site):
    rows = gc.kernel_rows(load_topology(ROOT / "topology.yaml"), lambda w: gpu)
    assert {(r.worker, r.kernel) for r in rows} == {(w, k) for w in ("prefill-0", "decode-0")
                                                    for k in ("sparse_mla_decode", "indexer", "topk")}
    dec = next(r for r in rows if r.worker == "decode-0" and r.kernel == "sparse_mla_decode")
    assert (dec.gpu_class, dec.runs, dec.where) == (gpu, decode, site)
    topk = next(r for r in rows if r.kernel == "topk")
    assert topk.where == "topk.topk_transform_paged_v2, indexer.topk_transform_paged_v2"


def test_kernels_on_a_gpu_without_a_class_or_on_mixed_classes_are_refused_by_name():
    topology = load_topology(ROOT / "topology.yaml")          # prefill GPUs 0-3, decode 4-7, all kernels
    h200 = dict.fromkeys(range(8), "sm_90")
    assert gc.kernel_problems(topology, h200) == []
    a100 = {**h200, **dict.fromkeys(range(4, 8), None)}
    problems = gc.kernel_problems(topology, a100)
    assert len(problems) == 1 and problems[0].startswith(
        "decode-0: kernels sparse_mla_decode, indexer, topk requested, but GPU(s) [4, 5, 6, 7] are of a compute "
        "capability none of the kernels' classes has")
    assert "set `kernels:` to false" in problems[0]
    mixed = {**h200, 5: "sm_120"}
    assert gc.kernel_problems(topology, mixed) == [
        "decode-0: its GPUs [4, 5, 6, 7] are of different classes ['sm_120', 'sm_90']; one server's TP ranks must "
        "share one class"]
    off = topology.model_copy(update={"kernels": topology.kernels.model_copy(
        update={"sparse_mla_decode": False, "indexer": False, "topk": False})})
    assert gc.kernel_problems(off, a100) == []                # nothing requested: SGLang's own kernels run


def test_plan_prints_the_table_for_the_class_it_is_given():
    out = subprocess.run([sys.executable, "-m", "dsv4_cluster.orchestrator.cli.main", "plan",
                          str(ROOT / "examples" / "rtx_pro_6000.yaml"), "--gpu-class", "sm_120", "--gpu-mib", "97887"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Kernels by GPU class (--gpu-class sm_120; kernels/dispatch.py):" in out.stdout
    assert "flash_mla_sm120.flash_mla_with_kvcache_sm120" in out.stdout and "gluon" not in out.stdout
    local = subprocess.run([sys.executable, "-m", "dsv4_cluster.orchestrator.cli.main", "plan",
                            str(ROOT / "examples" / "local.yaml")], capture_output=True, text=True, timeout=120)
    assert local.returncode == 0 and "Kernels by GPU class" not in local.stdout   # CPU workers: no GPU kernels
