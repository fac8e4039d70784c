"""SGLang 0.5.23's own DeepSeek-V4 decode attention backend on a GPU: stock vs our kernels via load_plugins().

Each mode runs in its own interpreter (`python -m bench.sglang_backend mode ...`: the plugin's
replacements are process-wide), on SGLang's backend, pool and decode metadata, for one window-only, one ratio-4
(indexer + top-512) and one ratio-128 layer at TP4 (16 heads padded to 64), batch 8, 4,096 live tokens per
request (1,024 C4 entries, so the top-512 is a real selection), configured context 128K. Eager and CUDA graph.

Stand-ins (bench/sglang_stand_ins.py, each installer says why): deep_gemm and SGLang's JIT
plan_topk_v2 in plugin mode (their outputs are read only by the kernels the plugin replaced), the compressor's
JIT decode plan (the compressor is not run), the model's C4Indexer projections (the rig passes projected q /
weights), and import-only modules the decode path never calls. Stock uses SGLang's own fallbacks where its
kernels cannot load beside torch 2.11: `fp8_paged_mqa_logits_torch` and `topk_transform_pytorch_vectorized`.
With SGLANG_BACKEND_RUNS naming the folder where the bench's two mode processes of the same device run wrote
this case (`bash bench/gpu.sh sglang_backend` does), the test checks those results instead of running the
modes again. Skips without CUDA (never in CI: CI has no GPU; the CPU side is tests/sglang/test_sglang_backend_cpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (SGLang's DeepSeek-V4 backend with FlashMLA)", allow_module_level=True)

LAYERS = "0,2,3"  # DeepSeek-V4-Flash: layer 0 window-only, 2 ratio 4, 3 ratio 128
CONTEXT, BATCH = 131072, 8  # the bench's equality case
RUNS_ENV = "SGLANG_BACKEND_RUNS"


def _reusable(out: Path) -> bool:
    """Mode results a bench run on this GPU wrote to `out` that hold this test's case (the device script
    runs the bench first and points RUNS_ENV at its folder: one SGLang import and JIT compile per mode)."""
    try:
        modes = [json.loads((out / f"{m}.json").read_text()) for m in ("stock", "plugin")]
    except (OSError, ValueError):
        return False
    return all(m["layers"] == f"ids {[int(x) for x in LAYERS.split(',')]}" and m["equality"]
               and (out / f"{m['mode']}_outputs.pt").exists()
               and any((x["context"], x["batch"]) == (CONTEXT, BATCH) for x in m["rows"]) for m in modes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    given = os.environ.get(RUNS_ENV)
    if given and _reusable(Path(given)):
        out = Path(given)
    else:
        out = tmp_path_factory.mktemp("sglang_backend")
        for mode in ("stock", "plugin"):
            proc = subprocess.run([sys.executable, "-m", "bench.sglang_backend", "mode", mode, str(out),
                                   "--contexts", str(CONTEXT), "--batches", str(BATCH), "--reps", "1",
                                   "--layer-ids", LAYERS],
                                  capture_output=True, text=True, timeout=300, env=dict(os.environ))
            assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    results = {mode: json.loads((out / f"{mode}.json").read_text()) for mode in ("stock", "plugin")}
    from bench.sglang_backend_report import compare

    eq = compare(out)
    if os.environ.get("OUT"):  # the device run's returned folder: the figures, whatever the asserts say
        (Path(os.environ["OUT"]) / "gpu_test_equality.json").write_text(json.dumps({"equality": eq, "dir": str(out)}))
    return results, eq


def test_the_plugin_was_installed_by_load_plugins_and_stock_was_not(runs):
    results, _ = runs
    assert results["stock"]["dsv4_factory"] == ["create_dsv4_backend"]
    assert results["plugin"]["dsv4_factory"] == ["create_dsv4_backend_with_dsv4_cluster_kernels"]


@pytest.mark.parametrize("kind", ["window", "ratio4", "ratio128"])
def test_outputs_equal_within_flashmla_tolerance(runs, kind):
    """Every row of the window and ratio-128 layers; the ratio-4 rows whose top-512 sets are equal (a row
    with a swapped tie attends over another entry: `compare` lists it with its error)."""
    _, eq = runs
    assert eq[kind]["ok"] and eq[kind]["rows"] >= BATCH // 2 and eq[kind]["rel_error"] < 0.01, eq[kind]


@pytest.mark.parametrize("kind", ["window", "ratio4", "ratio128"])
def test_our_decode_equals_flashmla_on_the_arguments_sglang_passed(runs, kind):
    """In the plugin process, FlashMLA on the very arguments SGLang handed our kernel (every row, ties or not)."""
    results, _ = runs
    same = results["plugin"]["equality"]["flashmla_same_inputs"]
    assert same[kind]["rel_error"] < 0.01, same


def test_topk_sets_equal(runs):
    _, eq = runs
    assert eq["topk"]["rows"] == 8 and eq["topk"]["ok"], eq["topk"]


def test_both_modes_ran_eager_and_graph(runs):
    results, _ = runs
    for mode in ("stock", "plugin"):
        (row,) = [x for x in results[mode]["rows"] if (x["context"], x["batch"]) == (CONTEXT, BATCH)]
        assert row["eager_ms"] > 0, (mode, row)
        assert row["graph_ms"] is not None and row["graph_ms"] > 0, (mode, row)
