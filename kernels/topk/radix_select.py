"""Triton top-k by radix select over each row's live prefix: O(live length), CUDA-graph safe.

Why not torch.topk: it sorts a whole fixed-width row, so a buffer sized for 1M context costs the
same at every live length (a 28.7x tax at 4K). Here every pass reads scores[b, :lens[b]] only.

How: scores become order-preserving uint32 keys; up to four 8-bit histogram passes find the key of
the k-th largest entry (a row stops once its pivot bin is taken whole); a gather writes the
winners. A (split, B) grid of programs strides over each row's live prefix; each pass adds their
local histograms into a per-row global one. On CUDA all of it is one launch: the programs of a row
meet at a per-row barrier (an atomic counter) after each pass, which is safe because the grid is
capped to what the GPU holds resident at once. The per-pass variant (one launch per pass, no
barrier) serves the Triton interpreter, which runs programs one after another. Grids and buffers
depend on B and k only, never on the score buffer's width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_cluster.kernels.fast_launch import launch as fast_launch
from dsv4_cluster.kernels.topk.radix_passes import (
    advance,
    gather,
    initial_state,
    local_histogram,
    select_passes,
)
from dsv4_cluster.kernels.topk.reference import TopkInputError, check_lens_in_range, check_topk_inputs

NUM_BINS = 256
NUM_PASSES = 4


def workspace_size(batch: int) -> int:
    """int32 elements of scratch: histograms [4, B, 256], barriers [4, B], slot counters [B]."""
    return NUM_PASSES * batch * NUM_BINS + NUM_PASSES * batch + batch


@triton.jit
def _topk_one_launch_kernel(scores_ptr, stride_sb, lens_ptr, hist_ptr, bar_ptr, count_ptr, out_ptr, stride_ob,
                            k, width, batch, split, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), width)
    row_ptr = scores_ptr + b.to(tl.int64) * stride_sb
    needed, prefix, nbits, ties, done = select_passes(row_ptr, n, k, pid, split, hist_ptr, bar_ptr, b, batch,
                                                      tl.zeros([256], dtype=tl.int32), False, BLOCK)
    gather(row_ptr, out_ptr + b * stride_ob, count_ptr + b, n, k, pid, split, needed, prefix, nbits, ties,
           BLOCK, K_BLOCK)


@triton.jit
def _hist_pass_kernel(scores_ptr, stride_sb, lens_ptr, hist_ptr, k, width, batch, split,
                      PASS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), width)
    bins = tl.arange(0, 256)
    needed, prefix, nbits, ties, done = initial_state(n, k)
    for p in tl.static_range(PASS):
        h = tl.load(hist_ptr + (p * batch + b) * 256 + bins)
        needed, prefix, nbits, ties, done = advance(h, needed, prefix, nbits, ties, done)
    if done == 0:
        acc = local_histogram(scores_ptr + b.to(tl.int64) * stride_sb, n, pid, split, prefix, PASS, BLOCK)
        tl.atomic_add(hist_ptr + (PASS * batch + b) * 256 + bins, acc, mask=acc > 0)


@triton.jit
def _gather_pass_kernel(scores_ptr, stride_sb, lens_ptr, hist_ptr, count_ptr, out_ptr, stride_ob,
                        k, width, batch, split, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), width)
    bins = tl.arange(0, 256)
    needed, prefix, nbits, ties, done = initial_state(n, k)
    for p in tl.static_range(4):
        h = tl.load(hist_ptr + (p * batch + b) * 256 + bins)
        needed, prefix, nbits, ties, done = advance(h, needed, prefix, nbits, ties, done)
    gather(scores_ptr + b.to(tl.int64) * stride_sb, out_ptr + b * stride_ob, count_ptr + b, n, k, pid, split,
           needed, prefix, nbits, ties, BLOCK, K_BLOCK)


def default_split(batch: int, device: torch.device) -> int:
    """Programs per row: about two per multiprocessor over the batch."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, -(-2 * sms // max(batch, 1)))


def resident_programs(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of a compiled kernel the GPU holds at once (shared memory, threads and,
    when Triton reports them, registers). Kernels whose programs wait for each other need the whole
    grid resident: their split is capped with this."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    per_sm = min(32, getattr(props, "max_threads_per_multi_processor", 2048) // threads)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    per_sm = min(per_sm, smem // (compiled.metadata.shared + 1024))  # 1 KB per block is reserved
    regs = getattr(compiled, "n_regs", 0) or 0
    if regs:
        regs_per_warp = -(-((regs + 7) // 8 * 8 * 32) // 256) * 256  # allocation granularity
        per_sm = min(per_sm, getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps))
    return max(1, per_sm) * props.multi_processor_count


_CAPPED: dict[tuple, int] = {}  # capped_split's answers: the warmup it needs costs as much host time as a launch


def capped_split(kernel, args: tuple, kwargs: dict, batch: int, split: int, device: torch.device) -> int:
    """`split`, lowered until the (split, batch) grid of `kernel` is resident at once (CUDA only); cached per
    kernel, device, batch, split, constexprs and the dtypes of the first three arguments (what the compiled
    resources depend on: the callers' other tensors have fixed dtypes, int32 or float32)."""
    key = (kernel, device.index, batch, split, tuple(kwargs.values()),
           tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args[:3]))
    if key not in _CAPPED:
        compiled = kernel.warmup(*args, grid=(split, batch), **kwargs)
        _CAPPED[key] = max(1, min(split, resident_programs(compiled, kwargs["num_warps"], device) // batch))
    return _CAPPED[key]


def topk_triton(
    scores: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    one_launch: bool | None = None,
    split: int | None = None,
    block: int = 2048,
    num_warps: int = 8,
    check_values: bool = True,
) -> torch.Tensor:
    """Indices of the k largest of scores[b, :lens[b]], -1 padded; the set `reference.topk_ref` returns.

    Shapes: scores [B, N] float32, bf16 or fp16 with unit column stride (N may be a graph-capture
    maximum: nothing past lens[b] is read); lens [B] int32/int64 on scores' device; k >= 1.
    Returns int32 [B, k] (`out` if given: int32 [B, k], unit column stride): row b holds the
    min(k, lens[b]) winners in an unspecified order (the set is deterministic: among equal
    scores the lower index wins), then -1. NaN scores are not allowed (their rank is undefined).
    workspace: optional contiguous int32 scratch of `workspace_size(B)` elements, zeroed here.
    one_launch: default True on CUDA; must be False in the Triton interpreter unless split == 1.
    With one_launch on CUDA, split is lowered to what the GPU holds resident at once.
    Under CUDA-graph capture, or with check_values=False, lens values are not checked (that reads device
    memory, a sync); the kernels clamp them to [0, N].
    """
    check_topk_inputs(scores, lens, k)
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16) or scores.stride(1) != 1:
        raise TopkInputError(f"topk_triton needs float32/bf16/fp16 scores with unit column stride; got {scores.dtype}")
    batch, width = scores.shape
    if check_values and not (scores.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_lens_in_range(lens, width)
    if out is None:
        out = torch.empty((batch, k), dtype=torch.int32, device=scores.device)
    elif tuple(out.shape) != (batch, k) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise TopkInputError(f"out must be int32 [B, k] = [{batch}, {k}] with unit column stride")
    size = workspace_size(batch)
    if workspace is None:
        workspace = torch.zeros(size, dtype=torch.int32, device=scores.device)
    elif workspace.numel() != size or workspace.dtype != torch.int32 or not workspace.is_contiguous():
        raise TopkInputError(f"workspace must be a contiguous int32 tensor of workspace_size(B) = {size} elements")
    else:
        workspace.zero_()
    if batch == 0:
        return out
    one_launch = scores.is_cuda if one_launch is None else one_launch
    if one_launch and not scores.is_cuda and split not in (None, 1):
        raise TopkInputError("the Triton interpreter runs programs one by one; one_launch needs split=1 there")
    split = split or (default_split(batch, scores.device) if scores.is_cuda or not one_launch else 1)
    hist_end = NUM_PASSES * batch * NUM_BINS
    hist, bars, counts = workspace[:hist_end], workspace[hist_end : size - batch], workspace[size - batch :]
    grid = (split, batch)
    k_block = min(1024, triton.next_power_of_2(k))
    if one_launch:
        args = (scores, scores.stride(0), lens, hist, bars, counts, out, out.stride(0), k, width, batch)
        kwargs = dict(BLOCK=block, K_BLOCK=k_block, num_warps=num_warps)
        if scores.is_cuda:
            split = capped_split(_topk_one_launch_kernel, args + (split,), kwargs, batch, split, scores.device)
        fast_launch(_topk_one_launch_kernel, (split, batch), args + (split,), kwargs)
        return out
    for p in range(NUM_PASSES):
        _hist_pass_kernel[grid](scores, scores.stride(0), lens, hist, k, width, batch, split,
                                PASS=p, BLOCK=block, num_warps=num_warps)
    _gather_pass_kernel[grid](scores, scores.stride(0), lens, hist, counts, out, out.stride(0), k, width, batch,
                              split, BLOCK=block, K_BLOCK=k_block, num_warps=num_warps)
    return out
