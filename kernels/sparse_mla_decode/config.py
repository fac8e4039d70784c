"""How a sparse-decode launch is configured: `LaunchConfig`, the defaults that fill it, the backend a call gets.

The backend and block config come from the dispatch table (`kernels/dispatch.py`: GPU class x heads ->
implementation); this module resolves a `LaunchConfig` against it and says why the Gluon kernel cannot take a
call. Shapes and device only (never tensor values), so every answer is cached and graph-capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .. import dispatch
from . import checks

DIM = 512


@dataclass(frozen=True)
class LaunchConfig:
    """How the work is cut: rows per block, splits per query (0 = choose from B), warps, stages, and
    whether block j + 1 is loaded before block j is computed (register prefetch)."""

    block_n: int = 0  # 0: the backend's default (see `resolved`)
    num_splits: int = 0
    num_warps: int = 0  # 0: the dispatch table's row for the call (else 8)
    num_stages: int = 0  # 0: the backend's default; Gluon: shared-memory stages of block_n rows
    prefetch: bool = False
    backend: str = "auto"  # "auto": the warp-specialised Gluon kernel where it applies (sm_90, H = 64), else "triton"
    # Gluon: registers per loader thread (0: see `resolved`); the S warpgroup gets what the loader and
    # the P V warpgroup (PV_REGS) leave
    loader_regs: int = 0
    # Gluon: merge the splits inside the kernel (a cooperative launch; only when B x splits CTAs fit on the
    # SMs at once), else with the merge kernel after it. None: fused from splits.FUSED_MERGE_MIN_SPLITS on
    fused_merge: bool | None = None
    # Gluon: stage the index table and Q before the per-query lengths are loaded (None: on bf16 rows with
    # the fused merge, i.e. at small B. On fp8 it measured slower at every B, e.g. B = 8 20.4 vs 19.9 us,
    # B = 32 29.3 vs 28.1, B = 64 37.9 vs 36.2; bf16 gains up to 0.3 us at B <= 32)
    early_table: bool | None = None
    # Triton: heads per program (0: all of the call's heads in one program); the rest go to more programs on
    # grid axis 2, each reading the same rows. The dispatch table sets it where a wide accumulator spills (sm_120).
    head_group: int = 0
    # mma.sync Gluon kernel on fp8 rows: dequantise four e4m3 bytes at a time in 32-bit words (gluon_mma_v2.E4M3_WORD;
    # 690 loop instructions a warp against 781 for sm_120a). None: the dispatch table row's choice
    fp8_words: bool | None = None
    # mma.sync Gluon kernel: move the softmax's reference max only when a block's max passes it by more than 2**8,
    # a CTA-wide decision, so most blocks skip O's rescale (gluon_mma_v2.LAZY_LOG2). None: the row's choice
    lazy_rescale: bool | None = None
    # mma.sync Gluon kernel at 64 heads: a launch whose splits hold at least this many blocks takes them two at a time
    # (gluon_mma_v2_pair.py; when `plan._pairs` allows). 0: never. None: the row's choice
    pair_min_blocks: int | None = None
    # the 16-head wgmma Gluon kernel (gluon_h16.py): its loader's warps (0: 8)
    loader_warps: int = 0


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4



BACKENDS = ("auto", "triton", "gluon", "gluon_mma_v2", "gluon_h16")
# (block_n, stages) when the config leaves them 0: the H200 sweep's most frequent winners
# (bench/results/sparse_decode.md).
DEFAULT_BLOCKS = {("triton", False): (64, 2), ("triton", True): (64, 2),
                  ("gluon", False): (64, 2), ("gluon", True): (64, 2),
                  ("gluon_mma_v2", False): (16, 2), ("gluon_mma_v2", True): (16, 2),
                  ("gluon_h16", False): (64, 2), ("gluon_h16", True): (64, 2)}
PV_REGS = 160  # registers per thread of the Gluon P V-only warpgroup (a 64 x 256 fp32 accumulator and little else)
SMEM_LIMIT = 226 * 1024  # the 227 KB a block may opt into, less a margin for what the estimate leaves out


def resolved(config: LaunchConfig | None, backend: str, is_fp8: bool) -> LaunchConfig:
    """`config` with its 0 (= default) block size and stage count filled in for this backend."""
    config = config or LaunchConfig()
    bn, stages = DEFAULT_BLOCKS[(backend, is_fp8)]
    bn = config.block_n or bn
    # Loader registers: the fp8 loader holds two 32-row rounds of records at once (128 leaves it
    # spill-free); the bf16 gather holds 16 row addresses per thread at block_n 64 (80 leaves it
    # spill-free), 8 at block_n 32.
    regs = config.loader_regs or (128 if is_fp8 else 80 if bn == 64 else 40)
    return replace(config, block_n=bn, num_stages=config.num_stages or stages, backend=backend, loader_regs=regs,
                   num_warps=config.num_warps or 8)


def gluon_index_blocks(w: int, k: int, block_n: int) -> int:
    """Rows of the Gluon kernel's index table: the live blocks of a query, rounded up to a power of two."""
    return triton_next_pow2(-(-w // block_n) + -(-k // block_n))


def gluon_smem_bytes(block_n: int, stages: int, w: int = 128, k: int = 512) -> int:
    """Shared memory of the Gluon kernel: Q, the bf16 row stages, the index table, two P buffers and
    the softmax rows handed between the compute warpgroups, barriers (w, k: window and extra lists per
    query). The same for bf16 and fp8: fp8 records are dequantised from registers."""
    table = gluon_index_blocks(w, k, block_n) * block_n * 4
    handoff = 2 * 64 * block_n * 2 + 4 * 64 * 4
    return 64 * DIM * 2 + stages * block_n * DIM * 2 + table + handoff + 8 * (2 * stages + 6)


def h16_smem_bytes(block_n: int, stages: int, w: int = 128, k: int = 512) -> int:
    """Shared memory of the 16-head Gluon kernel: Q (16 heads), the bf16 row stages, the index table, P^T, barriers."""
    return 16 * DIM * 2 + stages * block_n * DIM * 2 + gluon_index_blocks(w, k, block_n) * block_n * 4 + \
        16 * block_n * 2 + 8 * (2 * stages + 2)


def gluon_unavailable(q: torch.Tensor, is_fp8: bool) -> str | None:
    """Why the warp-specialised Gluon kernel cannot take this call (None: it can): the dispatch table gives it
    to sm_90 alone (a forced class counts), at 64 heads, on bf16 queries, on the Triton releases it was built for."""
    gpu = dispatch.class_of_device(q.device) if q.is_cuda else None
    return _gluon_unavailable(q.device, gpu, q.shape[1], q.dtype)


# Gluon is experimental and its API moves between Triton releases (3.9 renamed the cp.async entry point
# this kernel uses), so the kernel runs only on the releases it was built and tested with on the H200.
GLUON_TRITON_RELEASES = ("3.8",)


def gluon_api_unavailable() -> str | None:
    """Why this Triton cannot build the Gluon kernel (None: it can)."""
    import triton

    release = ".".join(triton.__version__.split(".")[:2])
    if release not in GLUON_TRITON_RELEASES:
        return (f"it is written against Triton {'/'.join(GLUON_TRITON_RELEASES)}'s Gluon API; this is Triton "
                f"{triton.__version__} (port the gluon_*.py kernel files, then add the release to "
                "GLUON_TRITON_RELEASES)")
    try:
        from . import gluon_kernel  # noqa: F401
    except ImportError as exc:  # a build without Gluon's Hopper API
        return f"Gluon does not import ({exc})"
    return None




def choose_backend(device: torch.device, h: int, dtype: torch.dtype, is_fp8: bool, config: LaunchConfig,
                   use_fallback: bool = False):
    """(backend, config resolved for it) of a call, from the dispatch table for the device's GPU class.

    "auto": the table's row for (class, h); a Gluon row falls back to the Triton kernel where Gluon cannot take
    the call on this build (non-bf16 q, a Triton release it was not written for), with the row's `fallback` config
    where it names one. "gluon" and "gluon_h16" are refused off sm_90; "gluon_mma_v2" runs on any CUDA GPU (64 or
    16 heads, bf16 q). A block size or stage count left 0 comes from the class's row (sm_120: its <= 99 KB config).
    use_fallback: the row's fallback stands in for it (the call's batch is under the row's `min_batch`, or its
    index table does not fit the 16-head kernel's shared memory)."""
    if config.backend not in BACKENDS:
        raise checks.SparseDecodeInputError(f"LaunchConfig.backend must be one of {BACKENDS}, got {config.backend!r}")
    return _choose(device, h, dtype, is_fp8, config, use_fallback)


@functools.lru_cache(maxsize=256)
def _choose(device, h, dtype, is_fp8, config, use_fallback=False):
    gpu = dispatch.class_of_device(device)
    row = dispatch.decode_impl(gpu, h) if gpu is not None and h in (16, 32, 64) else None
    if use_fallback and row is not None and row.fallback is not None:
        row = row.fallback  # below the row's min_batch, or a call its kernel cannot hold (plan / choose_backend_for)
    if config.backend == "gluon_h16" or (config.backend == "auto" and row is not None and row.backend == "gluon_h16"):
        why = h16_unavailable(device, gpu, h, dtype)
        if why is None:
            if row is not None and row.backend == "gluon_h16":
                config = replace(config, block_n=config.block_n or row.block_n,
                                 num_stages=config.num_stages or row.num_stages,
                                 loader_warps=config.loader_warps or row.loader_warps)
            return "gluon_h16", resolved(replace(config, loader_warps=config.loader_warps or 8), "gluon_h16", is_fp8)
        if config.backend == "gluon_h16":
            raise checks.SparseDecodeInputError(f"the 16-head Gluon kernel cannot run this call: {why}")
        row = row.fallback  # the class's config where the 16-head kernel cannot run (another Triton release)
    elif row is not None and row.backend == "gluon_h16":
        row = row.fallback  # another backend asked for: the mma.sync row under it, with its options
    # "auto" takes the mma.sync row on V4 fp8 caches alone (what SGLang passes, and what the stand-in measured);
    # bf16 rows keep the row's Triton fallback until the kernel's bf16 path has run on a GPU
    if config.backend == "gluon_mma_v2" or (config.backend == "auto" and row is not None
                                            and row.backend == "gluon_mma_v2" and is_fp8):
        why = mma_v2_unavailable(device, h, dtype)
        if why is None:
            if row is not None and row.backend == "gluon_mma_v2":
                config = replace(config, block_n=config.block_n or row.block_n,
                                 num_stages=config.num_stages or row.num_stages,
                                 num_warps=config.num_warps or row.num_warps,
                                 fp8_words=row.fp8_words if config.fp8_words is None else config.fp8_words,
                                 lazy_rescale=row.lazy_rescale if config.lazy_rescale is None else config.lazy_rescale,
                                 pair_min_blocks=(row.pair_min_blocks if config.pair_min_blocks is None
                                                  else config.pair_min_blocks))
            return "gluon_mma_v2", resolved(config, "gluon_mma_v2", is_fp8)
        if config.backend == "gluon_mma_v2":
            raise checks.SparseDecodeInputError(f"the mma.sync Gluon kernel cannot run this call: {why}; "
                                                "use backend='triton'")
    while row is not None and row.backend in ("gluon_h16", "gluon_mma_v2"):
        row = row.fallback  # the class's Triton config for this call (asked for, or where those cannot run)
    why = _gluon_unavailable(device, gpu, h, dtype)
    if config.backend == "gluon" and why:
        raise checks.SparseDecodeInputError(f"the Gluon kernel cannot run this call: {why}; use backend='triton'")
    backend = config.backend
    if backend == "auto":
        backend = "gluon" if row is not None and row.backend == "gluon" and not why else "triton"
    if row is not None and row.backend == backend:
        config = replace(config, block_n=config.block_n or row.block_n, num_stages=config.num_stages or row.num_stages,
                         head_group=config.head_group or row.head_group, num_warps=config.num_warps or row.num_warps)
    return backend, resolved(config, backend, is_fp8)


@functools.lru_cache(maxsize=1024)
def choose_backend_for(device: torch.device, h: int, dtype: torch.dtype, is_fp8: bool, config: LaunchConfig,
                       w: int, k: int, use_fallback: bool = False):
    """`choose_backend` for a call with w window and k extra indices per query. The Gluon kernel stages a
    query's whole index table in shared memory; where the table and the row stages do not fit (SGLang hands
    ratio-128 layers max_context / 128 extra indices: 8,192 at a configured 1M), an "auto" call whose block size
    was left to the table takes block_n 32 (half the row stages' bytes; the table is the same), and where that
    does not fit either, the Triton kernel, which streams its indices. A call that asked for "gluon" or for a
    block size keeps them (and its launch says why it cannot)."""
    backend, resolved_config = choose_backend(device, h, dtype, is_fp8, config, use_fallback)
    if (backend == "gluon_h16" and config.backend == "auto"
            and h16_smem_bytes(resolved_config.block_n, resolved_config.num_stages, w, k) > SMEM_LIMIT):
        return choose_backend(device, h, dtype, is_fp8, config, True)  # the mma.sync row streams its indices
    if (backend != "gluon" or config.backend != "auto"
            or gluon_smem_bytes(resolved_config.block_n, resolved_config.num_stages, w, k) <= SMEM_LIMIT):
        return backend, resolved_config
    if config.block_n == 0 and gluon_smem_bytes(32, resolved_config.num_stages, w, k) <= SMEM_LIMIT:
        return "gluon", resolved(replace(config, block_n=32, num_stages=resolved_config.num_stages), "gluon", is_fp8)
    return choose_backend(device, h, dtype, is_fp8, replace(config, backend="triton"))


def _gluon_unavailable(device, gpu, h, dtype) -> str | None:
    if device.type == "cuda" and not dispatch.allows_gluon(gpu):
        return f"it is written for sm_90 (Hopper); this GPU runs as {gpu}"
    return _gluon_call_unavailable(device, h, dtype, (64,), "all 64 heads as the wgmma M")


def h16_unavailable(device, gpu, h, dtype) -> str | None:
    """Why the 16-head wgmma Gluon kernel (`gluon_h16.py`) cannot take a call (None: it can): sm_90, 16 heads, bf16
    queries, a Triton release its Gluon API was written against."""
    if device.type == "cuda" and not dispatch.allows_gluon(gpu):
        return f"it is written for sm_90 (Hopper); this GPU runs as {gpu}"
    return _gluon_call_unavailable(device, h, dtype, (16,), "16 heads as the wgmma N")


def mma_v2_unavailable(device, h, dtype) -> str | None:
    """Why the mma.sync Gluon kernel (`gluon_mma_v2.py`, written for sm_120, any GPU with mma.sync runs it) cannot
    take a call (None: it can): CUDA, 64 or 16 heads (16 a warp along M), bf16 queries, a Triton release its
    Gluon API was written against."""
    return _gluon_call_unavailable(device, h, dtype, (64, 16), "64 or 16 heads (warp rows of 16 heads)")


def _gluon_call_unavailable(device, h, dtype, heads: tuple[int, ...], heads_as: str) -> str | None:
    """What both Gluon kernels need of a call: CUDA tensors, a head count in `heads` (taken as `heads_as`), bf16
    queries, and a Triton release their Gluon API was written against."""
    if device.type != "cuda":
        return "it runs on CUDA tensors only"
    if h not in heads:
        return f"it takes {heads_as}; got H={h}"
    if dtype != torch.bfloat16:
        return f"it takes bf16 queries; got {dtype}"
    return gluon_api_unavailable()


def triton_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()

