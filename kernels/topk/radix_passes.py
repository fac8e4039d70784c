"""The Triton building blocks of the radix select, shared by its one-launch and per-pass kernels.

A row's selection state after each 8-bit pass is (needed, prefix, nbits, ties, done): the pivot
key's top `nbits` bits are `prefix`, `needed` entries carrying that prefix still belong to the top
k, `ties` entries carry it, and `done` says no further pass is needed (the pivot bin is taken
whole, or the row has at most k live entries and is taken whole). Every program of a row derives
the same state from the same histograms, so no program has to publish it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sortable_key(x):
    """float32 -> uint32 whose unsigned order is the float order; -0.0 and +0.0 map alike."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for negatives, the sign bit for positives
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def initial_state(n, k):
    needed = tl.minimum(n, k)
    prefix = tl.zeros([], dtype=tl.uint32)
    nbits = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    return needed, prefix, nbits, ties, n <= k


@triton.jit
def advance(h, needed, prefix, nbits, ties, done):
    """Fold one pass's 256-bin histogram h (of entries carrying `prefix`) into the state."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
    pivot = tl.max(tl.where(at_or_above >= needed, bins, -1), axis=0)
    in_pivot = tl.sum(tl.where(bins == pivot, h, 0), axis=0)
    above = tl.sum(tl.where(bins == pivot, at_or_above, 0), axis=0) - in_pivot
    new_needed = needed - above
    needed = tl.where(done, needed, new_needed)
    prefix = tl.where(done, prefix, (prefix << 8) | pivot.to(tl.uint32))
    nbits = tl.where(done, nbits, nbits + 8)
    ties = tl.where(done, ties, in_pivot)
    done = done | (in_pivot == new_needed)
    return needed, prefix, nbits, ties, done


@triton.jit
def publish_and_advance(acc, hist_ptr, bar_ptr, p, b, batch, split, needed, prefix, nbits, ties, done):
    """Add this program's histogram for pass p to row b's, wait at the row's barrier until all
    `split` programs of the row have, then fold the row's histogram into the state. The barrier
    also makes every score the row's programs stored before it visible to all of them after it."""
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + (p * batch + b) * 256 + bins, acc, mask=acc > 0)
    tl.debug_barrier()  # every thread's stores and atomics are done before the arrival below
    arrived = tl.atomic_add(bar_ptr + p * batch + b, 1) + 1
    while arrived < split:
        arrived = tl.atomic_add(bar_ptr + p * batch + b, 0)
    h = tl.load(hist_ptr + (p * batch + b) * 256 + bins, volatile=True)
    return advance(h, needed, prefix, nbits, ties, done)


@triton.jit
def local_histogram(row_ptr, n, pid, split, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit PASS (bits 31-8*PASS .. 24-8*PASS) over this program's share of the live
    prefix, counting only entries whose higher digits equal `prefix`."""
    acc = tl.zeros([256], dtype=tl.int32)
    for start in range(pid * BLOCK, n, split * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        key = sortable_key(tl.load(row_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32))
        if PASS > 0:
            m = m & ((key >> (32 - 8 * PASS)) == prefix)
        digit = ((key >> (24 - 8 * PASS)) & 255).to(tl.int32)
        acc += tl.histogram(digit, 256, mask=m)
    return acc


@triton.jit
def select_passes(row_ptr, n, k, pid, split, hist_ptr, bar_ptr, b, batch, first_hist,
                  HAS_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One row's radix passes (up to four, meeting the row's other programs after each): the state `gather`
    takes. HAS_FIRST: pass 0's local histogram is `first_hist` (the fused indexer counts it while scoring);
    otherwise every pass reads the row (`first_hist` is then only a placeholder of its type)."""
    needed, prefix, nbits, ties, done = initial_state(n, k)
    acc = first_hist
    for p in tl.static_range(4):
        if done == 0:
            if p > 0 or not HAS_FIRST:
                acc = local_histogram(row_ptr, n, pid, split, prefix, p, BLOCK)
            needed, prefix, nbits, ties, done = publish_and_advance(acc, hist_ptr, bar_ptr, p, b, batch, split,
                                                                    needed, prefix, nbits, ties, done)
    return needed, prefix, nbits, ties, done


@triton.jit
def gather(row_ptr, out_row_ptr, count_ptr, n, k, pid, split, needed, prefix, nbits, ties,
           BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    """Write the winners' indices: entries above the pivot key (and pivot-key entries when all of
    them fit) through a per-row atomic slot counter; when only some pivot-key entries fit, program 0
    takes the lowest indices, in index order, after them. Program 0 also pads with -1."""
    take_all = n <= k
    all_ties = take_all | (ties == needed)
    shift = tl.where(take_all, 0, 32 - nbits).to(tl.uint32)
    if pid == 0:
        for j in range(0, k, K_BLOCK):
            slot = j + tl.arange(0, K_BLOCK)
            tl.store(out_row_ptr + slot, tl.full([K_BLOCK], -1, tl.int32), mask=(slot >= n) & (slot < k))
    for start in range(pid * BLOCK, n, split * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        top = sortable_key(tl.load(row_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)) >> shift
        sel = (m & (take_all | (top > prefix) | (all_ties & (top == prefix)))).to(tl.int32)
        count = tl.sum(sel, axis=0)
        if count > 0:
            base = tl.atomic_add(count_ptr, count)
            tl.store(out_row_ptr + base + tl.cumsum(sel, axis=0) - 1, offs, mask=sel > 0)
    if (pid == 0) & (all_ties == 0):
        first = tl.minimum(n, k) - needed
        taken = tl.zeros([], dtype=tl.int32)
        start = tl.zeros([], dtype=tl.int32)
        while (start < n) & (taken < needed):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            key = sortable_key(tl.load(row_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32))
            tie = (m & (key == prefix)).to(tl.int32)
            rank = taken + tl.cumsum(tie, axis=0) - 1
            tl.store(out_row_ptr + first + rank, offs, mask=(tie > 0) & (rank < needed))
            taken += tl.sum(tie, axis=0)
            start += BLOCK
