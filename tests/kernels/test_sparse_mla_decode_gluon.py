"""Sparse MLA decode: the warp-specialised Gluon kernel (sm_90, H = 64) against the reference on the GPU,
and its host side (launch binding, Triton release gate) without one."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.sparse_mla_decode import (
    SparseDecodeInputError,
    quantize_kv_v4,
)
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, launch
from dsv4_cluster.kernels.sparse_mla_decode.launch import (
    LaunchConfig,
    sparse_mla_decode_fp8_triton,
    sparse_mla_decode_triton,
)
from tests.kernels.sparse_decode_cases import (HAS_CUDA, V4, assert_close, fp8_reference64, make_case, moved,
                                               odd_e4m3_cache, reference64, v4_call)


def gluon_ready():
    return HAS_CUDA and launch.gluon_unavailable(torch.empty(1, 64, 512, dtype=torch.bfloat16, device="cuda"), False) is None


gluon_gpu = pytest.mark.skipif(not gluon_ready(), reason="needs an sm_90 GPU and Triton's Gluon")


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_n, stages", [(64, 2), (32, 3), (32, 4)])
@pytest.mark.parametrize("b, splits", [(1, 0), (8, 0), (8, 1), (64, 3), (130, 0)])
def test_gpu_gluon_matches_reference(block_n, stages, b, splits):
    c = make_case(b, **V4, device="cuda", seed=100 + b + splits, sink=b % 2 == 0)
    cfg = LaunchConfig(block_n=block_n, num_stages=stages, num_splits=splits, backend="gluon")
    out, lse = sparse_mla_decode_triton(**c, config=cfg)
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@gluon_gpu
@pytest.mark.gpu
def test_gpu_gluon_window_only_and_full_lengths():
    c = make_case(5, 64, 128, 0, 4096, 0, device="cuda", seed=7, ragged=False, sink=False)
    out, lse = sparse_mla_decode_triton(**c, config=LaunchConfig(backend="gluon"))
    ref_out, ref_lse = reference64(c)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@gluon_gpu
@pytest.mark.gpu
def test_gpu_auto_backend_is_gluon_for_v4_bf16():
    c = make_case(2, **V4, device="cuda", seed=3)
    auto = sparse_mla_decode_triton(**c)   # no config: the dispatch table's backend
    forced = sparse_mla_decode_triton(**c, config=LaunchConfig(backend="gluon"))
    assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1])


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("k", [8192, 16384])
def test_gpu_auto_backend_takes_an_index_table_too_wide_for_the_default_gluon_block(fp8, k):
    """SGLang hands ratio-128 layers max_context / 128 extra indices: 8,192 at a configured 1M (Gluon at
    block_n 32), 16,384 at 2M (Triton). auto runs both and equals the reference; forced Gluon at block_n 64
    says why not."""
    c = make_case(3, 64, 128, k, 8192, 16384, device="cuda", seed=11 + k + fp8)
    run, (ref_out, ref_lse) = v4_call(c, fp8, LaunchConfig())
    out, lse = run()
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)
    run, _ = v4_call(c, fp8, LaunchConfig(backend="gluon", block_n=64))
    with pytest.raises(SparseDecodeInputError, match="shared memory"):
        run()


def test_auto_takes_a_smaller_gluon_block_then_triton_where_the_index_table_does_not_fit(monkeypatch):
    from dsv4_cluster.kernels.sparse_mla_decode import config as cfg_mod

    def table_row(device, h, dtype, is_fp8, config, use_fallback=False):  # the table's sm_90 row at 64 heads
        backend = "triton" if config.backend == "triton" else "gluon"
        return backend, cfg_mod.resolved(config, backend, is_fp8)

    monkeypatch.setattr(cfg_mod, "choose_backend", table_row)
    cfg_mod.choose_backend_for.cache_clear()
    try:
        dev, bf16 = torch.device("cpu"), torch.bfloat16

        def choice(config, k):
            backend, resolved = cfg_mod.choose_backend_for(dev, 64, bf16, True, config, 128, k)
            assert resolved.backend == backend
            return backend, resolved.block_n

        for k in (512, 2048):        # ratio 4's top-512; ratio 128 at a configured 256K
            assert choice(LaunchConfig(), k) == ("gluon", 64)
        assert cfg_mod.gluon_smem_bytes(64, 2, 128, 8192) > cfg_mod.SMEM_LIMIT
        assert choice(LaunchConfig(), 8192) == ("gluon", 32)       # ratio 128 at a configured 1M
        assert cfg_mod.gluon_smem_bytes(32, 2, 128, 16384) > cfg_mod.SMEM_LIMIT
        assert choice(LaunchConfig(), 16384) == ("triton", 64)     # at 2M
        # asked for by name or block size: kept, and its launch refuses it with the reason
        assert choice(LaunchConfig(backend="gluon"), 16384) == ("gluon", 64)
        assert choice(LaunchConfig(block_n=64), 8192) == ("triton", 64)
    finally:
        cfg_mod.choose_backend_for.cache_clear()


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_n, stages, loader_regs", [(64, 2, 0), (64, 2, 96), (32, 3, 0), (32, 2, 80)])
@pytest.mark.parametrize("b, splits", [(1, 0), (8, 0), (64, 3), (130, 0)])
def test_gpu_gluon_fp8_matches_reference(block_n, stages, loader_regs, b, splits):
    c = make_case(b, **V4, device="cuda", seed=200 + b + splits, sink=b % 2 == 1)
    cfg = LaunchConfig(block_n=block_n, num_stages=stages, num_splits=splits, backend="gluon", loader_regs=loader_regs)
    run, (ref_out, ref_lse) = v4_call(c, True, cfg)
    out, lse = run()
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_n, stages", [(64, 2), (32, 3)])
def test_gpu_gluon_fp8_dequantises_subnormals_and_large_scales_exactly(block_n, stages):
    c = make_case(6, **V4, device="cuda", seed=31, sink=True)
    c["q"] = c["q"] * 0.02
    cache, extra = odd_e4m3_cache(c.pop("kv"), 1), odd_e4m3_cache(c.pop("extra_kv"), 2)
    for t in (cache, extra):  # scales past 2**7 (ue8m0 > 134) and subnormal e4m3 bytes are both in play
        scales = t[:, fp8_layout.SCALES_OFFSET:fp8_layout.SCALES_OFFSET + 64 * fp8_layout.SCALE_BYTES]
        assert scales.reshape(-1, fp8_layout.SCALE_BYTES)[:, :fp8_layout.NUM_TILES].max() > 134
        assert ((t[:, :fp8_layout.SCALES_OFFSET].reshape(-1, 576)[:, :448] & 0x78) == 0).any()
    cfg = LaunchConfig(block_n=block_n, num_stages=stages, backend="gluon")
    out, lse = sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra, config=cfg)
    cpu = moved(c, "cpu")
    ref_out, ref_lse = fp8_reference64(cpu, cache, extra)
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("b, splits", [(1, 10), (8, 5), (3, 16), (32, 4), (66, 2)])
def test_gpu_gluon_fused_merge_matches_reference_and_leaves_the_counters_at_zero(monkeypatch, fp8, b, splits):
    """Splits merged inside the kernel (cooperative launch): within the tolerance like the merge kernel, on
    every split count (3 x 16: six splits with no rows at all; 66 x 2 = 132: every SM), and the counters
    end at zero."""
    merges, merge_kernel = [], launch._combine
    monkeypatch.setattr(launch, "_combine", lambda *a: (merges.append(a), merge_kernel(*a)))
    c = make_case(b, **V4, device="cuda", seed=300 + b, sink=b % 2 == 0)
    for fused in (True, False):
        run, (ref_out, ref_lse) = v4_call(c, fp8, LaunchConfig(num_splits=splits, backend="gluon", fused_merge=fused))
        for _ in range(3):  # the counters must be back at zero for the next launch
            out, lse = run()
        assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)
        assert len(merges) == (0 if fused else 3)
        merges.clear()
    torch.cuda.synchronize()
    assert not launch._SPLIT_COUNTERS[torch.cuda.current_device()].any()


@gluon_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("b, splits", [(5, 1), (4, 3)])
def test_gpu_gluon_index_table_staged_before_or_after_the_lengths(fp8, early, b, splits):
    """The index table laid out by W and K (staged before the lengths) or by the lengths: same results, on
    ragged lengths, window-only queries and queries with no rows."""
    c = make_case(b, **V4, device="cuda", seed=400 + b, sink=True)
    c["window_lens"][0], c["extra_lens"][0] = 0, 0
    c["extra_lens"][1] = 0
    run, (ref_out, ref_lse) = v4_call(c, fp8, LaunchConfig(num_splits=splits, backend="gluon", early_table=early))
    out, lse = run()
    assert_close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@gluon_gpu
@pytest.mark.gpu
def test_gpu_gluon_fused_merge_captured_before_any_eager_call(monkeypatch):
    """A graph captured with no counters kept yet captures its own zeroed counters, and replays correctly."""
    c = make_case(8, **V4, device="cuda", seed=78)
    cfg = LaunchConfig(num_splits=5, backend="gluon")
    sparse_mla_decode_triton(**c, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    monkeypatch.setattr(launch, "_SPLIT_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = sparse_mla_decode_triton(**c, config=cfg)
    assert launch._SPLIT_COUNTERS == {}
    for seed in (79, 80):
        fresh = make_case(8, **V4, device="cuda", seed=seed)
        for key in ("q", "window_idx", "extra_idx", "window_lens", "extra_lens"):
            c[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference64(c)
        assert_close(g_out.cpu(), g_lse.cpu(), ref_out, ref_lse, torch.bfloat16)


_POISONED_COUNTERS = """
import time
import torch
from dsv4_cluster.kernels.sparse_mla_decode import launch
from dsv4_cluster.kernels.sparse_mla_decode.launch import LaunchConfig, sparse_mla_decode_triton
from tests.kernels.sparse_decode_cases import V4, make_case
c = make_case(2, **V4, device="cuda", seed=81)
cfg = LaunchConfig(num_splits=5, backend="gluon", fused_merge=True)
sparse_mla_decode_triton(**c, config=cfg)
torch.cuda.synchronize()
# 40 arrivals from 0xFFFFFFF0 wrap around to 24 < 40: query 0's splits can never all be seen to arrive
launch._SPLIT_COUNTERS[torch.cuda.current_device()][0] = -16
torch.cuda.synchronize()
t0 = time.monotonic()
try:
    sparse_mla_decode_triton(**c, config=cfg)
    torch.cuda.synchronize()
except RuntimeError as exc:
    print(f"LAUNCH FAILED after {time.monotonic() - t0:.3f} s:", exc, flush=True)
    raise SystemExit(3)
print("LAUNCH RETURNED", flush=True)
"""


@gluon_gpu
@pytest.mark.gpu
def test_gpu_gluon_fused_merge_fails_instead_of_hanging_on_counters_that_cannot_complete():
    """Counters that can never reach the split count (here: poisoned) make the launch fail with a CUDA error
    once the bounded wait runs out (gluon_epilogue.SPIN_LIMIT_NS), in a child process whose CUDA context that
    error ends, rather than spin forever."""
    import re
    import subprocess
    import sys

    from dsv4_cluster.kernels.sparse_mla_decode import gluon_epilogue

    proc = subprocess.run([sys.executable, "-c", _POISONED_COUNTERS], capture_output=True, text=True, timeout=180)
    failed = re.search(r"LAUNCH FAILED after ([0-9.]+) s", proc.stdout)
    assert proc.returncode == 3 and failed, proc.stdout + proc.stderr
    # it waited the bound out, then failed (not some other error at once)
    assert gluon_epilogue.SPIN_LIMIT_NS * 1e-9 <= float(failed.group(1)) < 60, proc.stdout


@gluon_gpu
@pytest.mark.gpu
def test_gpu_gluon_rejects_a_config_over_shared_memory():
    c = make_case(2, **V4, device="cuda", seed=5)
    cache, extra = quantize_kv_v4(c.pop("kv")), quantize_kv_v4(c.pop("extra_kv"))
    with pytest.raises(SparseDecodeInputError, match="shared memory"):
        sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra,
                                     config=LaunchConfig(block_n=64, num_stages=3, backend="gluon"))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_launch_passes_every_kernel_parameter(monkeypatch, fp8, fused):
    """Host side of the Gluon kernel without a GPU: the launch binds every kernel parameter exactly once,
    with the split merge behind it when there are splits, or (when every CTA fits on the SMs at once) a
    cooperative launch that merges them itself (the kernel itself runs only on sm_90)."""
    from dsv4_cluster.kernels.sparse_mla_decode import gluon_kernel

    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, grid, args, kwargs))

    kernel = gluon_kernel._sparse_decode_ws_kernel
    stream_merge = launch._kernels._combine_stream_kernel
    monkeypatch.setattr(gluon_kernel, "_sparse_decode_ws_kernel", Recorder(kernel))
    monkeypatch.setattr(launch._kernels, "_combine_kernel", Recorder(launch._kernels._combine_kernel))
    monkeypatch.setattr(launch._kernels, "_combine_stream_kernel", Recorder(launch._kernels._combine_stream_kernel))
    monkeypatch.setattr(launch, "_num_sms", lambda device: 132 if fused else 4)  # 3 x 4 CTAs fit on 132 SMs
    monkeypatch.setattr(launch, "_SPLIT_COUNTERS", {})
    c = make_case(3, 64, 128, 512, 300, 200, seed=8)
    cfg = launch.resolved(LaunchConfig(backend="gluon", num_splits=4), "gluon", fp8)  # fused_merge None: auto
    if fp8:
        caches = (quantize_kv_v4(c["kv"]), fp8_layout.PAGE_STRIDE, quantize_kv_v4(c["extra_kv"]), fp8_layout.PAGE_STRIDE)
    else:
        caches = (c["kv"], c["kv"].stride(0), c["extra_kv"], c["extra_kv"].stride(0))
    from dsv4_cluster.kernels.sparse_mla_decode import plan as plan_mod

    # the dispatch table gives Gluon to sm_90 CUDA calls only: this CPU call takes that row's launch
    monkeypatch.setattr(plan_mod, "choose_backend_for", lambda device, h, dtype, is_fp8, config, w, k: ("gluon", config))
    plan_mod.plan_launch.cache_clear()
    try:
        launch._launch(c["q"], *caches, c["window_idx"], c["extra_idx"], c["sink"], None,
                       c["window_lens"], c["extra_lens"], 128, 512, fp8, cfg)
    finally:
        plan_mod.plan_launch.cache_clear()
    (fn, grid, args, kwargs), *merge = launches
    assert grid == (3, 4)
    required = [name for name, p in zip(kernel.arg_names, kernel.params) if not p.has_default]
    options = ("num_warps", "launch_cooperative_grid")  # launch options, not parameters
    bound = kernel.arg_names[:len(args)] + [k for k in kwargs if k not in options]
    assert sorted(bound) == sorted(set(bound)), "a parameter is bound twice"
    assert set(required) <= set(bound), f"unbound: {set(required) - set(bound)}"
    assert set(bound) <= set(kernel.arg_names), f"unknown: {set(bound) - set(kernel.arg_names)}"
    assert kwargs["IS_FP8"] is fp8 and kwargs["SPLIT_OUT"] is True and kwargs["MAXB"] == (16 if cfg.block_n == 64 else 32)
    assert kwargs["FUSE_MERGE"] is fused and kwargs["launch_cooperative_grid"] is fused
    assert kwargs["EARLY_TABLE"] is (fused and not fp8)  # staged before the lengths: bf16 with the fused merge only
    counters = args[kernel.arg_names.index("counter_ptr")]
    if fused:
        assert merge == []  # the kernel merges: no merge kernel after it
        assert (kwargs["SP"], kwargs["MHT"], kwargs["MDC"]) == (4, 16, 128)  # 4 splits of 16 heads, 128 dims a time
        assert counters is launch._SPLIT_COUNTERS[None] and counters.dtype == torch.int32
        assert counters.numel() >= launch.COUNTER_STRIDE * 3 and not counters.any()
    else:
        assert merge[0][0] is stream_merge  # 4 splits: the streaming merge
        assert launch._SPLIT_COUNTERS == {}  # no counters when the merge kernel runs


def test_fused_merge_tile_stays_at_64_registers_per_thread():
    from dsv4_cluster.kernels.sparse_mla_decode import gluon_epilogue

    assert gluon_epilogue.COUNTER_STRIDE.value == launch.COUNTER_STRIDE  # the kernel and the buffer agree
    for splits in range(2, 33):
        sp, mht, mdc = gluon_epilogue.fused_merge_tile(splits)
        assert sp >= splits and mht * splits >= 64 and 16 <= mdc <= 128
        assert sp * mht * mdc // 128 <= 64 or mdc == 16


def test_gluon_is_refused_with_the_reason_on_an_untested_triton(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert "Triton 3.8" in launch.gluon_api_unavailable()
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    assert launch.gluon_api_unavailable() is None
