"""The one kernel dispatch table: GPU class x call x shape -> implementation, as data.

The plugin (which SGLang call site a kernel replaces and with what), the embedded engine (`workers/engine/kernel_ops.py`)
and the benchmarks read it; nothing else decides Gluon vs Triton or a launch config.

GPU classes are SGLang's (`get_platform().is_sm90 / is_sm100 / is_sm120`: compute capability major 9, 10, 12).
Per class and call the table names the implementation and, for the sparse decode, its launch config with the
shared memory one block of it needs as compiled for that class. A config never needs more than the class allows
a block (`SMEM_PER_BLOCK`: 227 KB on sm_90/sm_100, 99 KB on sm_120): `decode_impl` refuses a row that breaks it, and the tests
compile every sm_120 config for sm_120 (ptxas from Triton's wheel, no GPU needed) to check the figures.

The Gluon kernel (warp-specialised, wgmma) is written for sm_90 alone: no row of another
class names it, and `decode_impl` refuses it there. The mma.sync Gluon kernel (`gluon_mma_v2`) is written for sm_120
(99 KB, no wgmma); it runs on any GPU with mma.sync, so the H200 stand-in times and tests it as it is, and sm_90
runs it at 16 heads, where wgmma's M of 64 would compute 48 padded heads.

Forcing a class (`CLASS_ENV`, benches and GPU tests only): an H200 stands in for sm_120 with
`DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1`. The second variable makes Triton compile `tl.dot` to mma.sync,
the instruction sm_120 has (it has no wgmma); a kernel so compiled needs the same shared memory as compiled for
sm_120 (seen: 98,304 / 81,920 B for both, 64 / 16 heads), so the 99 KB cap is tested on the H200.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from dsv4_cluster.core import KERNEL_NAMES

GPU_CLASSES = ("sm_90", "sm_100", "sm_120")
CLASS_OF_MAJOR = {9: "sm_90", 10: "sm_100", 12: "sm_120"}
# Shared memory a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin): 227 KB on Hopper and datacenter
# Blackwell, 99 KB on RTX Blackwell (RTX PRO 6000, RTX 50xx).
SMEM_PER_BLOCK = {"sm_90": 227 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024}
CLASS_ENV = "DSV4_CLUSTER_GPU_CLASS"
MMA_V2_ENV = "DISABLE_MMA_V3"  # Triton: compile tl.dot to mma.sync (sm_120's MMA) on an sm_90 GPU
EXAMPLE_GPUS = {"sm_90": "H100 / H200 / H20", "sm_100": "B200 / B300", "sm_120": "RTX PRO 6000 Blackwell"}


WGMMA_BACKENDS = ("gluon", "gluon_h16")  # the Gluon kernels written for sm_90 (wgmma) alone


class DispatchError(ValueError):
    """A GPU, class or shape the table has no implementation for (the message says which and why)."""


@dataclass(frozen=True)
class DecodeImpl:
    """One sparse-decode launch: kernel backend, rows per block, pipeline stages, and the shared memory one
    block needs as compiled for its class (bytes; `metadata.shared` of the compiled kernel, see the tests)."""

    backend: str  # "gluon" (wgmma, sm_90) | "gluon_h16" (wgmma at 16 heads, sm_90) | "gluon_mma_v2" (mma.sync) | "triton"
    block_n: int
    num_stages: int
    smem: int
    head_group: int = 0  # heads per program (0: all); `smem` is one such program's
    num_warps: int = 8   # warps per program (Triton and the mma.sync Gluon kernel)
    # the mma.sync Gluon kernel's options (LaunchConfig's fields of the same names; a config's own value wins)
    fp8_words: bool = False
    lazy_rescale: bool = False
    pair_min_blocks: int = 0  # 64 heads: blocks a split needs to take them two at a time (0: never; plan._pairs)
    loader_warps: int = 0  # the 16-head wgmma Gluon kernel's loader warps (LaunchConfig.loader_warps)
    # the row that runs where this one's kernel cannot (a Gluon row on a Triton release it was not built for) or
    # below min_batch queries, where it measured slower
    fallback: "DecodeImpl | None" = None
    min_batch: int = 1


# (class, heads computed) -> implementation. Heads: what the call computes (16 / 32 / 64).
# sm_90: Gluon takes all 64 heads as its wgmma M (H200 sweeps, bench/results/sparse_decode.md); 16 heads run, from
# B = 32, on the 16-head wgmma Gluon kernel (`gluon_h16.py`: the heads as wgmma's N, 8 loader warps; H100, Triton
# 3.8.0, graph, c4 B = 32 / 64 / 128 / 256: 1.36 / 1.81 / 1.41 / 1.46x FlashMLA, bench/results/sglang_decode.md), and
# below B = 32 on the mma.sync Gluon kernel (4 warps, both options below; c4 B = 1 / 8: 1.40 / 1.25x, where the wgmma
# one measured 0.99x at B = 8), with the 16-head Triton kernel (block 64, 2 stages: the sweep's most frequent winner)
# under both (another Triton release) and for 32 heads. sm_100: the same Triton configs (Triton
# compiles them to tcgen05 there; Gluon's kernel is Hopper-only). sm_120: the configs under 99 KB as compiled for
# sm_120 — mma.sync keeps the [heads, 512] fp32 accumulator in registers: a 64-head (or 32-head) Triton program
# spills ~4 KB (400 B) a thread (ptxas for sm_120a), so the Triton rows run programs of 16 heads (head groups reading
# the same rows), block 32, one stage, 4 warps. At 64 heads from B = 8, and at 16 heads, the mma.sync Gluon kernel
# (`gluon_mma_v2.py`: each row gathered and dequantised once for all heads, block 16, two stages) replaces them, with
# fp8 dequantised four bytes at a time and the lazy rescale. H100 standing in, forced sm_120, Triton 3.8.0, c4, graph
# replay, B = 1 / 8 / 32 / 64 / 128 (bench/results/sm120_backends.md, sm120_reference.md): 64 heads, 8 warps, 16.0 /
# 23.8 / 40.8 / 61.9 / 99.0 us against the Triton row's 13.9 / 32.3 / 72.3 / 122.7 / 216.2 (below B = 8 the Triton
# row runs; 16 warps measured slower at every B); 16 heads, 4 warps, 13.2 / 16.2 / 28.4 / 41.7 / 66.6 against the
# Triton row's 13.4 / 19.7 / 35.2 / 55.2 / 89.5. Both run on fp8 caches only; bf16 rows keep the Triton fallback.
# The 64-head sm_120 row takes the ratio-4 layer's blocks two at a time where a split holds 10 or more
# (gluon_mma_v2_pair.py; H100 standing in, c4, graph: B = 32 / 64 / 128, 10 / 20 / 40 blocks a split, 39.7 / 57.6 /
# 89.9 us against 41.1 / 62.0 / 100.1; paired at B = 16, 5 a split, it measured 30.8 against 29.6).
PAIR_MIN_BLOCKS = 10
SPARSE_DECODE: dict[tuple[str, int], DecodeImpl] = {
    ("sm_90", 64): DecodeImpl("gluon", 64, 2, 218_192),
    ("sm_90", 32): DecodeImpl("triton", 64, 2, 164_096),
    ("sm_90", 16): DecodeImpl("gluon_h16", 64, 2, 153_920, num_warps=4, loader_warps=8, min_batch=32,
                              fallback=DecodeImpl("gluon_mma_v2", 16, 2, 49_664, num_warps=4, fp8_words=True,
                                                  lazy_rescale=True, fallback=DecodeImpl("triton", 64, 2, 147_712))),
    ("sm_100", 64): DecodeImpl("triton", 64, 2, 135_440),
    ("sm_100", 32): DecodeImpl("triton", 64, 2, 164_096),
    ("sm_100", 16): DecodeImpl("triton", 64, 2, 147_712),
    ("sm_120", 64): DecodeImpl("gluon_mma_v2", 16, 2, 100_352, num_warps=8, min_batch=8, fp8_words=True,
                               lazy_rescale=True, pair_min_blocks=PAIR_MIN_BLOCKS,
                               fallback=DecodeImpl("triton", 32, 1, 81_920, head_group=16, num_warps=4)),
    ("sm_120", 32): DecodeImpl("triton", 32, 1, 81_920, head_group=16, num_warps=4),
    ("sm_120", 16): DecodeImpl("gluon_mma_v2", 16, 2, 49_664, num_warps=4, fp8_words=True, lazy_rescale=True,
                               fallback=DecodeImpl("triton", 32, 1, 81_920, num_warps=4)),
}
# The Triton config a ratio-128 (dense) call of the embedded engine uses: its index list is as wide as the
# configured context, which the Gluon kernel's shared-memory index table cannot hold.
DENSE_DECODE_BACKEND = "triton"
# Indexer (fused scores + top-512) and top-k: the same Triton kernels on every class (no tl.dot wider than
# what mma.sync takes; the forced-sm_120 GPU test checks every compiled kernel against the 99 KB cap).
INDEXER = {c: "triton" for c in GPU_CLASSES}
TOPK = {c: "triton" for c in GPU_CLASSES}


def class_of_capability(capability: tuple[int, int]) -> str:
    """SGLang's GPU class of a compute capability; DispatchError for one SGLang's DeepSeek-V4 path has no class for."""
    major = capability[0]
    if major not in CLASS_OF_MAJOR:
        raise DispatchError(
            f"compute capability {capability[0]}.{capability[1]} is none of the GPU classes the kernels are built "
            f"for ({', '.join(f'{c}: {EXAMPLE_GPUS[c]}' for c in GPU_CLASSES)})")
    return CLASS_OF_MAJOR[major]


def forced_class(env: dict[str, str] | None = None) -> str | None:
    """The class `CLASS_ENV` forces (benches and GPU tests), None when unset; DispatchError for a bad value."""
    env = os.environ if env is None else env
    value = (env.get(CLASS_ENV) or "").strip()
    if not value:
        return None
    if value not in GPU_CLASSES:
        raise DispatchError(f"{CLASS_ENV}={value!r} is not a GPU class; use one of {', '.join(GPU_CLASSES)}")
    return value


@functools.lru_cache(maxsize=16)
def gpu_class(device_index: int) -> str:
    """The class of CUDA device `device_index`, or the forced one. Forcing sm_120 on a GPU with wgmma needs
    `DISABLE_MMA_V3=1` (else Triton compiles wgmma code whose shared memory is not sm_120's): refused without."""
    import torch

    actual = class_of_capability(torch.cuda.get_device_capability(device_index))
    forced = forced_class()
    if forced is None or forced == actual:
        return actual
    if forced == "sm_120" and os.environ.get(MMA_V2_ENV) != "1":
        raise DispatchError(f"{CLASS_ENV}=sm_120 on an {actual} GPU needs {MMA_V2_ENV}=1 set before Triton compiles "
                            "anything, so tl.dot compiles to mma.sync as on sm_120")
    return forced


def class_of_device(device) -> str | None:
    """The class of a torch device (None for CPU: the references / the interpreter run there)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return gpu_class(index)


def decode_impl(gpu: str, heads: int) -> DecodeImpl:
    """The sparse-decode implementation for `heads` computed heads on class `gpu`."""
    impl = SPARSE_DECODE.get((gpu, heads))
    if impl is None:
        raise DispatchError(f"no sparse-decode implementation for {heads} heads on {gpu}: the kernels compute 16, "
                            f"32 or 64 heads on {', '.join(GPU_CLASSES)}")
    if impl.smem > SMEM_PER_BLOCK[gpu] or (impl.backend in WGMMA_BACKENDS and gpu != "sm_90"):
        raise DispatchError(f"the table's sparse-decode row for {gpu} at {heads} heads breaks its class's limits: "
                            + "; ".join(check_table()))
    return impl


def allows_gluon(gpu: str | None) -> bool:
    """Whether class `gpu` may run the Gluon kernel (sm_90 alone; None = CPU: never)."""
    return gpu is not None and any(impl.backend == "gluon" for (c, _), impl in SPARSE_DECODE.items() if c == gpu)


def implementation(gpu: str, kernel: str, heads: int = 64) -> str:
    """What runs for `kernel` on class `gpu` ("gluon" / "triton"): the name the engine and benches report."""
    if kernel == "sparse_mla_decode":
        return decode_impl(gpu, heads).backend
    if kernel == "indexer":
        return INDEXER[gpu]
    if kernel == "topk":
        return TOPK[gpu]
    raise DispatchError(f"unknown kernel {kernel!r}; known: {', '.join(KERNEL_NAMES)}")


def check_table() -> list[str]:
    """Every row's problems (empty when the table is sound): a config over its class's shared memory, Gluon off
    sm_90, a class or kernel without a row."""
    problems = []
    for (gpu, heads), impl in SPARSE_DECODE.items():
        if impl.smem > SMEM_PER_BLOCK[gpu]:
            problems.append(f"sparse decode on {gpu} at {heads} heads needs {impl.smem} B of shared memory per block, "
                            f"over the {SMEM_PER_BLOCK[gpu]} B the class allows")
        if impl.backend in WGMMA_BACKENDS and gpu != "sm_90":
            problems.append(f"sparse decode on {gpu} names a wgmma Gluon kernel ({impl.backend}), which is written "
                            "for sm_90 alone")
    for gpu in GPU_CLASSES:
        for heads in (16, 32, 64):
            if (gpu, heads) not in SPARSE_DECODE:
                problems.append(f"no sparse decode row for {gpu} at {heads} heads")
        if gpu not in INDEXER or gpu not in TOPK:
            problems.append(f"no indexer / top-k row for {gpu}")
    return problems

