"""Shared by the sparse-decode test modules: random cases, the float64 reference and the tolerance check, a V4
cache with every dequantisation path in play, and a launch on bf16 or fp8 rows beside its reference."""

from __future__ import annotations

import torch

from dsv4_cluster.kernels.sparse_mla_decode import (fp8_layout, quantize_kv_v4, sparse_mla_decode_fp8_ref,
                                                    sparse_mla_decode_ref)
from dsv4_cluster.kernels.sparse_mla_decode.launch import sparse_mla_decode_fp8_triton, sparse_mla_decode_triton

HAS_CUDA = torch.cuda.is_available()
# Relative L2 error of `out` against a float64 reference on the same (dequantised) rows. bf16/fp16:
# the output is rounded to 8 (11) mantissa bits and P is rounded to bf16 before the PV product, so a
# few 1e-3; fp32 under the interpreter is numpy float32 arithmetic; on the GPU fp32 uses ieee dots.
OUT_RTOL = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# Absolute error of lse (natural log): scores are float32 sums of bf16 products.
LSE_ATOL = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-5}


def make_case(b, h, w, k, n, m, dtype=torch.bfloat16, device="cpu", d=512, seed=0, ragged=True, sink=True):
    """Random queries over random caches, with invalid entries, ragged lengths and one empty query."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    kv = torch.randn(n, d, generator=g).to(dtype)
    extra = torch.randn(m, d, generator=g).to(dtype) if k else None
    widx = torch.randint(0, n, (b, w), generator=g, dtype=torch.int32)
    widx[:, ::5] = -1
    eidx = torch.randint(0, m, (b, k), generator=g, dtype=torch.int32) if k else None
    wl = el = None
    if ragged:
        wl = torch.randint(0, w + 1, (b,), generator=g, dtype=torch.int32)
        wl[0] = w
        if k:
            el = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
            el[0] = k
    if b > 1:  # the last query has no valid row at all
        widx[-1] = -1
        if k:
            eidx[-1] = -1
    sink_t = torch.randn(h, generator=g) if sink else None
    args = dict(q=q, kv=kv, window_idx=widx, extra_kv=extra, extra_idx=eidx, sink=sink_t,
                window_lens=wl, extra_lens=el)
    return moved(args, device)


def moved(case, device):
    """The case with its tensors on `device` (other values as they are)."""
    return {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in case.items()}


def reference64(case):
    """The float64 reference on the CPU, for a case on any device."""
    c = moved(case, "cpu")
    c["q"] = c["q"].double()
    c["kv"] = c["kv"].double()
    if c["extra_kv"] is not None:
        c["extra_kv"] = c["extra_kv"].double()
    return sparse_mla_decode_ref(**c)


def assert_close(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "output holds NaN/inf"
    err = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    assert err < OUT_RTOL[dtype], f"relative error {err:.2e} over {OUT_RTOL[dtype]:.0e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty queries must give lse -inf, only they"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin].double()).abs().max().item() < LSE_ATOL[dtype]
    assert (out[~fin] == 0).all(), "a query with no valid row must give out 0"


# DeepSeek-V4 CSA shapes for the GPU tests: 64 heads, a 128-row window, top-512 over a 4096-entry cache.
V4 = dict(h=64, w=128, k=512, n=8192, m=4096)


def odd_e4m3_cache(kv: torch.Tensor, seed: int) -> torch.Tensor:
    """A V4 cache whose e4m3 bytes are small (exponent field 0-3: a quarter of them subnormal) and whose
    scales reach 2**10, past the range one bf16 multiplication could carry: every dequantisation path."""
    g = torch.Generator().manual_seed(seed)
    cache = quantize_kv_v4(kv.cpu())
    pages = cache.shape[0]
    records = cache[:, :fp8_layout.SCALES_OFFSET].view(pages, fp8_layout.PAGE_TOKENS, fp8_layout.RECORD_BYTES)
    n = pages * fp8_layout.PAGE_TOKENS * fp8_layout.NOPE_DIMS
    sign = torch.randint(0, 2, (n,), generator=g) << 7
    exponent = torch.randint(0, 4, (n,), generator=g) << 3
    mantissa = torch.randint(0, 8, (n,), generator=g)
    nope = records[..., :fp8_layout.NOPE_DIMS]
    nope.copy_((sign | exponent | mantissa).to(torch.uint8).view(nope.shape))
    scales = cache[:, fp8_layout.SCALES_OFFSET:fp8_layout.SCALES_OFFSET + fp8_layout.PAGE_TOKENS * fp8_layout.SCALE_BYTES]
    scales = scales.view(pages, fp8_layout.PAGE_TOKENS, fp8_layout.SCALE_BYTES)[..., :fp8_layout.NUM_TILES]
    scales.copy_(torch.randint(126, 138, scales.shape, generator=g).to(torch.uint8))
    return cache.to(kv.device)


def fp8_reference64(cpu, cache, extra):
    """The float64 reference of a case on the CPU whose rows are the fp8 caches `cache` and `extra`."""
    return sparse_mla_decode_fp8_ref(**{**cpu, "q": cpu["q"].double()}, kv_cache=cache.cpu(), extra_cache=extra.cpu())


def v4_call(c, fp8, config):
    """A sparse-decode launch (as `config` picks it) on case c (bf16 rows, or the same rows quantised to the V4 fp8
    layout) and the float64 reference of what it was given."""
    c = dict(c)
    cpu = moved(c, "cpu")
    if not fp8:
        return (lambda: sparse_mla_decode_triton(**c, config=config)), reference64(cpu)
    cache, extra = quantize_kv_v4(c.pop("kv")), quantize_kv_v4(c.pop("extra_kv"))
    for k in ("kv", "extra_kv"):
        cpu.pop(k)
    ref = fp8_reference64(cpu, cache, extra)
    return (lambda: sparse_mla_decode_fp8_triton(**c, kv_cache=cache, extra_cache=extra, config=config)), ref


def assert_graph_replays(c, config):
    """A launch captured in a CUDA graph replays on new inputs in the same buffers as an eager call does."""
    eager = sparse_mla_decode_triton(**c, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_mla_decode_triton(**c, config=config)
    c["q"].copy_(torch.flip(c["q"], dims=[0]))  # new inputs, same buffers
    graph.replay()
    again = sparse_mla_decode_triton(**c, config=config)
    assert torch.equal(captured[0], again[0]) and torch.equal(captured[1], again[1])
    assert not torch.equal(captured[0], eager[0])
