"""The dispatch table (CI): every class has a row per call, Gluon on sm_90 alone, every sm_120 config within
99 KB of shared memory as compiled for sm_120 (Triton's own compiler and ptxas, no GPU needed), and the table's
figure for each is the compiled one."""

from __future__ import annotations

import subprocess

import pytest

from dsv4_cluster.kernels import dispatch
from tests.zygote import compile_child


def test_table_is_sound_and_gluon_is_sm90_only():
    assert dispatch.check_table() == []
    assert [dispatch.allows_gluon(c) for c in dispatch.GPU_CLASSES] == [True, False, False]
    assert dispatch.allows_gluon(None) is False
    assert {dispatch.implementation("sm_120", k, h) for k in ("sparse_mla_decode", "indexer", "topk")
            for h in (16, 32, 64)} - {"triton"} == {"gluon_mma_v2"}
    assert dispatch.decode_impl("sm_120", 64).fallback.backend == "triton"
    assert max(dispatch.decode_impl("sm_120", h).smem for h in (16, 32, 64)) <= 99 * 1024


def test_a_row_over_its_class_limit_is_refused(monkeypatch):
    monkeypatch.setitem(dispatch.SPARSE_DECODE, ("sm_120", 64), dispatch.DecodeImpl("triton", 64, 2, 196_864))
    assert "over the 101376 B" in " ".join(dispatch.check_table())
    with pytest.raises(dispatch.DispatchError, match="breaks its class's limits"):
        dispatch.decode_impl("sm_120", 64)
    monkeypatch.setitem(dispatch.SPARSE_DECODE, ("sm_120", 64), dispatch.DecodeImpl("gluon", 64, 2, 90_000))
    with pytest.raises(dispatch.DispatchError, match="Gluon kernel"):
        dispatch.decode_impl("sm_120", 64)


@pytest.mark.parametrize("cap, cls", [((9, 0), "sm_90"), ((10, 0), "sm_100"), ((12, 0), "sm_120")])
def test_classes_of_capabilities(cap, cls):
    assert dispatch.class_of_capability(cap) == cls


def test_unknown_gpu_and_bad_forced_class_are_refused_by_name():
    with pytest.raises(dispatch.DispatchError, match="compute capability 8.0"):
        dispatch.class_of_capability((8, 0))
    with pytest.raises(dispatch.DispatchError, match="sm_121"):
        dispatch.forced_class({dispatch.CLASS_ENV: "sm_121"})
    assert dispatch.forced_class({}) is None


def _compiled(heads: int, impl: dispatch.DecodeImpl, capability: int, words: bool | None = None,
              lazy: bool | None = None) -> tuple[int, int]:
    """Compiled in a process without TRITON_INTERPRET (tests/zygote.compile_child says why). Returns (shared
    memory per program, spill-store bytes per thread)."""
    pytest.importorskip("triton")
    words = impl.fp8_words if words is None else words  # the row's own options unless asked otherwise
    lazy = impl.lazy_rescale if lazy is None else lazy
    code = (f"from tests.kernels.test_dispatch import _compile_here; "
            f"print(_compile_here({impl.head_group or heads}, {impl.block_n}, {impl.num_stages}, {capability}, "
            f"{impl.num_warps}, {impl.backend!r}, {words}, {lazy}))")
    rc, stdout, stderr = compile_child(code)
    assert rc == 0, stderr[-3000:]
    shared, spills = stdout.split()[-2:]
    return int(shared), int(spills)


def _compile_here(heads: int, block_n: int, num_stages: int, capability: int, num_warps: int = 8,
                  backend: str = "triton", words: bool = False, lazy: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    common = dict(H=heads, BN=block_n, SPLIT_OUT=True, IS_FP8=True, HAS_EXTRA=True, HAS_WLEN=True, HAS_ELEN=True,
                  HAS_SINK=True, W_SHIFT=8, W_PAGE=149_760, E_SHIFT=6, E_PAGE=37_440)
    if backend == "gluon_h16":
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

        from dsv4_cluster.kernels.sparse_mla_decode import gluon_h16 as k

        common.pop("H")
        fn, const = k._sparse_decode_h16_kernel, dict(common, NS=num_stages, LOADER_WARPS=8, LOADER_REGS=128, MAXB=16)
        options = dict(num_warps=num_warps)
    elif backend in ("gluon_mma_v2", "gluon_mma_v2_pair"):
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

        from dsv4_cluster.kernels.sparse_mla_decode import gluon_mma_v2, gluon_mma_v2_pair

        fn = gluon_mma_v2_pair._sparse_decode_mma_v2_pair_kernel if backend == "gluon_mma_v2_pair" else \
            gluon_mma_v2._sparse_decode_mma_v2_kernel
        const = dict(common, WORDS=words, LAZY=lazy)
        options = dict(num_warps=num_warps)
    else:
        from triton.compiler import ASTSource

        from dsv4_cluster.kernels.sparse_mla_decode import kernel as k

        fn, const = k._sparse_decode_kernel, dict(common, D=512, DOT_F32=False, PREFETCH=False)
        options = dict(num_warps=num_warps, num_stages=num_stages)
    ptrs = {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": "*u8", "ekv_ptr": "*u8", "sink_ptr": "*fp32",
            "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*i32" if n.endswith("_ptr") else
                                                        "fp32" if n == "qk_scale_log2" else "i32")
           for n in fn.arg_names}
    # pointers 16-byte aligned, as the launch specialises them (the vector width of every load depends on it)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")
               or (backend == "gluon_h16" and n.startswith("stride"))}  # its Q goes by 16-byte cp.async
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()}, attrs=aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    return f"{compiled.metadata.shared} {_spill_bytes(compiled.asm['ptx'], capability)}"


def _spill_bytes(ptx: str, capability: int) -> int:
    """Spill stores of the kernel as ptxas (Triton's own, for this target) reports them."""
    import re
    import tempfile
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = bin_dir / ("ptxas-blackwell" if capability >= 100 else "ptxas")
    if not ptxas.exists():  # a Triton install stripped of it (the device carry drops ptxas-blackwell); CI has it
        pytest.skip(f"Triton's {ptxas.name} is not installed: nothing compiles for sm_{capability} here")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{capability}a", str(src), "-o", str(src) + ".o"],
                              capture_output=True, text=True, check=True)
    found = re.search(r"(\d+) bytes spill stores", done.stdout + done.stderr)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("heads", [16, 32, 64])
def test_sm120_configs_compiled_for_sm120_fit_99_kb(heads, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    impl = dispatch.decode_impl("sm_120", heads)
    for row in (impl, impl.fallback) if impl.fallback else (impl,):
        shared, spills = _compiled(heads, row, 120)
        assert shared == row.smem and shared <= dispatch.SMEM_PER_BLOCK["sm_120"], row
        # a 64-head Triton program spilled ~4 KB a thread on sm_120: hence its head groups. Compiled as launched
        # (16-byte aligned pointers: vector loads) the 16-head Triton programs spill 4 B; the Gluon kernel none.
        assert spills <= (8 if row.backend == "triton" else 0), row


def test_the_mma_v2_options_the_bench_times_compile_for_sm120_within_99_kb(monkeypatch):
    """LaunchConfig(fp8_words=True), lazy_rescale=True and num_warps=16 on the sm_120 row, alone and together (the
    option columns bench/sm120_backends.py times beside the row): within 99 KB, and spilling no more than measured here
    (fp8 words: none; 16 warps: 116 B and 100 B with fp8 words, 128 registers; lazy rescale: 32 B, none with fp8 words,
    156 B and 76 B at 16 warps)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from dataclasses import replace

    row = dispatch.decode_impl("sm_120", 64)
    for warps, words, lazy, spill_max in ((8, True, False, 0), (16, False, False, 128), (16, True, False, 128),
                                          (8, False, True, 32), (8, True, True, 0), (16, False, True, 160),
                                          (16, True, True, 80)):
        shared, spills = _compiled(64, replace(row, num_warps=warps), 120, words, lazy)
        assert shared <= dispatch.SMEM_PER_BLOCK["sm_120"] and spills <= spill_max, (warps, words, lazy, spills)


def test_the_paired_mma_v2_kernel_compiles_for_sm120_as_the_row_launches_it(monkeypatch):
    """The kernel taking two blocks at a time, with the 64-head sm_120 row's options (8 warps, fp8 words, lazy
    rescale): within 99 KB and no spill for sm_120a."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from dataclasses import replace

    row = dispatch.decode_impl("sm_120", 64)
    assert row.pair_min_blocks > 0 and (row.num_warps, row.fp8_words) == (8, True)
    assert _compiled(64, replace(row, backend="gluon_mma_v2_pair"), 120) == (row.smem, 0)


def test_the_sm90_16_head_rows_compile_for_sm90a_as_the_table_says(monkeypatch):
    """The sm_90 16-head row runs the 16-head wgmma kernel (8 loader warps) from B = 32, the mma.sync kernel (4 warps,
    both options) below: for sm_90a each needs the shared memory its row names and spills nothing."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    row = dispatch.decode_impl("sm_90", 16)
    assert (row.backend, row.min_batch, row.loader_warps) == ("gluon_h16", 32, 8)
    assert (row.fallback.backend, row.fallback.fallback.backend) == ("gluon_mma_v2", "triton")
    assert _compiled(16, row, 90) == (row.smem, 0)
    assert _compiled(16, row.fallback, 90) == (row.fallback.smem, 0)
