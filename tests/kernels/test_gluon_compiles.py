"""The Gluon decode kernel compiles for sm_90a on the pinned Triton, here on a CPU (Triton's own compiler and ptxas,
no GPU), for every variant a launch can ask for: fp8 / bf16 rows, block 32 / 64, split / unsplit, the fused
merge, the early index table. Gluon's API moves between Triton releases (3.8 dropped `thread_barrier` and refuses a
shared-memory view smaller than its buffer), so CI must compile the kernel on the release users install: the
interpreter never runs Gluon. Each variant's launch keywords are the ones `plan._gluon_plan` builds for real
shapes, and its compiled shared memory is the one `config.gluon_smem_bytes` budgets. The 16-head wgmma kernel
(`gluon_h16.py`) the same way, with `plan._h16_plan` and `config.h16_smem_bytes`."""

from __future__ import annotations

import json

import pytest

from tests.zygote import compile_child

# (is_fp8, batch, window, extra, block_n, fused_merge, early_table): the launches SGLang's calls produce on an H200
# (132 SMs): B = 1 fp8 splits with the fused merge; B = 128 unsplit; a ratio-128 list at 1M (8,192 extra) on
# block 32; bf16 with the early table.
VARIANTS = [
    (True, 1, 128, 512, 0, None, None),
    (True, 128, 128, 512, 0, None, None),
    (True, 8, 128, 8192, 32, None, None),
    (False, 4, 128, 512, 0, None, None),
    (False, 64, 128, 0, 64, False, True),
]

# the kernel's source as the JIT specialises a real launch: 16-byte aligned pointers and strides divisible by 16
SOURCE = """ptrs = {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "ekv_ptr": "*u8" if fp8 else "*bf16",
        "sink_ptr": "*fp32", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
sig = {n: "constexpr" if n in kw else ptrs.get(n, "*i32" if n.endswith("_ptr") else
       "fp32" if n == "qk_scale_log2" else "i32") for n in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or n.startswith("stride")}
src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in kw.items()}, attrs=attrs)
"""

CHILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsv4_cluster.kernels.sparse_mla_decode import config as cfg, gluon_kernel, plan
from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import DEFAULT_GEOMETRY

fp8, b, w, k, bn, fused, early = json.loads(sys.argv[1])
conf = cfg.resolved(cfg.LaunchConfig(block_n=bn, fused_merge=fused, early_table=early), "gluon", fp8)
flags = (k > 0, True, k > 0, True)
splits, fuse, kw = plan._gluon_plan(b, w, k, fp8, conf, 132, flags, (DEFAULT_GEOMETRY, DEFAULT_GEOMETRY))
fn = gluon_kernel._sparse_decode_ws_kernel
options = {n: kw.pop(n) for n in ("num_warps", "launch_cooperative_grid")}
{SOURCE}done = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=options["num_warps"]))
print(json.dumps(dict(shared=done.metadata.shared, budget=cfg.gluon_smem_bytes(conf.block_n, conf.num_stages, w, k),
                      splits=splits, fuse=fuse, cubin=bool(done.asm.get("cubin")),
                      wgmma="wgmma.mma_async" in done.asm["ptx"], triton=triton.__version__)))
""".replace("{SOURCE}", SOURCE)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "fp8" if v[0] else "bf16")
def test_gluon_kernel_compiles_for_sm90a_within_its_budget(variant):
    pytest.importorskip("triton")
    from dsv4_cluster.kernels.sparse_mla_decode import config

    if config.gluon_api_unavailable() is not None:
        pytest.fail(f"the Gluon kernel does not build on this Triton: {config.gluon_api_unavailable()}")
    code, stdout, stderr = compile_child(CHILD, json.dumps(variant))
    assert code == 0, stderr[-4000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["cubin"] and got["wgmma"], got
    # the budget counts every buffer the kernel allocates; the compiler may add alignment padding only
    assert got["budget"] <= got["shared"] <= got["budget"] + 1024, got
    assert got["shared"] <= config.SMEM_LIMIT, got


# (is_fp8, batch, window, extra): the 16-head wgmma kernel's launches (plan._h16_plan, 132 SMs): c4 at B = 32 (split)
# and 128, ratio 128 at a configured 1M (its 8,192-entry index table in shared memory), bf16 rows.
H16_VARIANTS = [(True, 32, 128, 512), (True, 128, 128, 512), (True, 64, 128, 8192), (False, 64, 128, 512)]

H16_CHILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsv4_cluster.kernels.sparse_mla_decode import config as cfg, gluon_h16, plan
from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import DEFAULT_GEOMETRY

fp8, b, w, k = json.loads(sys.argv[1])
conf = cfg.resolved(cfg.LaunchConfig(block_n=64, num_stages=2, loader_warps=8), "gluon_h16", fp8)
flags = (k > 0, True, k > 0, True)
splits, kw = plan._h16_plan(b, w, k, fp8, conf, 132, flags, (DEFAULT_GEOMETRY, DEFAULT_GEOMETRY))
fn = gluon_h16._sparse_decode_h16_kernel
num_warps = kw.pop("num_warps")
{SOURCE}done = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
print(json.dumps(dict(shared=done.metadata.shared, budget=cfg.h16_smem_bytes(64, 2, w, k), splits=splits,
                      cubin=bool(done.asm.get("cubin")), wgmma="wgmma.mma_async" in done.asm["ptx"])))
""".replace("{SOURCE}", SOURCE)


@pytest.mark.parametrize("variant", H16_VARIANTS, ids=lambda v: f"{'fp8' if v[0] else 'bf16'}-b{v[1]}-k{v[3]}")
def test_16_head_kernel_compiles_for_sm90a_within_its_budget(variant):
    from dsv4_cluster.kernels.sparse_mla_decode import config

    if config.gluon_api_unavailable() is not None:
        pytest.fail(f"the Gluon kernels do not build on this Triton: {config.gluon_api_unavailable()}")
    code, stdout, stderr = compile_child(H16_CHILD, json.dumps(variant))
    assert code == 0, stderr[-4000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["cubin"] and got["wgmma"], got
    assert got["budget"] <= got["shared"] <= got["budget"] + 1024 and got["shared"] <= config.SMEM_LIMIT, got
