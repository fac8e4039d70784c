"""Indexer + top-512 at live length L against buffers sized for a larger configured maximum:
`python -m bench.kernels indexer_topk [--batch 32] [--lives 4096,65536,262144] [--maxima L,131072,1048576]`.

Decode's cost must follow the live length, not `--context-length`. For B requests of L tokens (L/4 compressed
entries, 64 per page) and a maximum M (page table and score buffer sized for M), cold L2, median: ours (the fused
Triton indexer + radix-select top-k, one launch, as a replayed CUDA graph; also indexer and top-k as two launches,
and each alone); torch (scoring + torch.topk over the whole buffer, eager, keys contiguous or gathered through the
page table); DeepGEMM's fp8_paged_mqa_logits + torch.topk when its wheel loads (else why not). GB/s counts the key
bytes the indexer must read, against the copy bandwidth of the same run. Correctness is checked first.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import ints, md_columns
from bench.kernels import bench_us, copy_bandwidth_gbs, graphed, write_results
from dsv4_cluster.kernels.indexer.fp8_keys import quantize_keys
from dsv4_cluster.kernels.indexer.fused_topk import indexer_topk_triton
from dsv4_cluster.kernels.indexer.reference import indexer_fp8_ref, indexer_ref
from dsv4_cluster.kernels.indexer.triton_indexer import indexer_fp8_triton, indexer_triton
from dsv4_cluster.kernels.topk.radix_select import topk_triton, workspace_size
from dsv4_cluster.kernels.topk.reference import topk_ref

HEADS, DIM, PER_PAGE, K = 64, 128, 64, 512
KI = 1024


def make_inputs(batch: int, live: int, maximum: int, seed: int = 0, device: str = "cuda") -> dict:
    """Live entries of each request on shuffled physical pages; the page table sized for `maximum`
    tokens, its unused columns pointing at page 0 (so the O(max) torch baseline can gather them)."""
    g = torch.Generator(device=device).manual_seed(seed)
    entries, max_entries = live // 4, maximum // 4
    live_pages, max_pages = entries // PER_PAGE, max_entries // PER_PAGE
    pages = batch * live_pages
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
    table[:, :live_pages] = torch.randperm(pages, device=device, generator=g).view(batch, live_pages).to(torch.int32)
    return {
        "q": torch.randn(batch, HEADS, DIM, device=device, generator=g).to(torch.bfloat16),
        "w": torch.randn(batch, HEADS, device=device, generator=g) * HEADS**-0.5,
        "keys": torch.randn(pages, PER_PAGE, DIM, device=device, generator=g).to(torch.bfloat16),
        "table": table,
        "lens": torch.full((batch,), entries, dtype=torch.int32, device=device),
    }


def contiguous_keys(x: dict) -> torch.Tensor:
    """Every request's keys laid out contiguously, [B, max_pages*E, Di]: PyTorch's cheapest layout."""
    batch, max_pages = x["table"].shape
    return x["keys"][x["table"].long()].view(batch, max_pages * PER_PAGE, DIM).contiguous()


def torch_scores_topk(x: dict, keys: torch.Tensor | None = None) -> torch.Tensor:
    """The O(max) pattern: score every column of the buffer, mask past lens, torch.topk. Without
    `keys`, the keys are first gathered through the page table (paged); with them, read in place.
    Two bf16 batched matmuls (q.k, then the weighted sum over heads): PyTorch's fastest form here."""
    if keys is None:
        keys = contiguous_keys(x)
    logits = torch.relu_(torch.bmm(x["q"], keys.transpose(1, 2)))  # [B, H, W] bf16
    scores = torch.bmm(x["w"].to(logits.dtype)[:, None, :], logits)[:, 0].float()  # [B, W]
    t = torch.arange(scores.shape[1], device=scores.device)
    scores = scores.masked_fill(t[None, :] >= x["lens"][:, None], float("-inf"))
    return torch.topk(scores, min(K, scores.shape[1]), dim=1).indices


class Ours:
    """Indexer + top-k with every buffer allocated once (scores sized for the maximum), graph-capturable."""

    def __init__(self, x: dict, fp8: bool):
        self.x, self.fp8 = x, fp8
        batch, max_pages = x["table"].shape
        self.keys = quantize_keys(x["keys"]) if fp8 else x["keys"]
        self.scores = torch.empty(batch, max_pages * PER_PAGE, device="cuda")
        self.idx = torch.empty(batch, K, dtype=torch.int32, device="cuda")
        self.workspace = torch.zeros(workspace_size(batch), dtype=torch.int32, device="cuda")

    def fused(self) -> None:
        indexer_topk_triton(self.x["q"], self.x["w"], self.keys, self.x["table"], self.x["lens"], K, fp8=self.fp8,
                            scores=self.scores, out=self.idx, workspace=self.workspace)

    def indexer(self) -> None:
        fn = indexer_fp8_triton if self.fp8 else indexer_triton
        fn(self.x["q"], self.x["w"], self.keys, self.x["table"], self.x["lens"], out=self.scores)

    def topk(self) -> None:
        topk_triton(self.scores, self.x["lens"], K, out=self.idx, workspace=self.workspace)

    def __call__(self) -> None:
        self.indexer()
        self.topk()

    def graph_us(self, fn=None) -> float:
        """Median time of one replay of a CUDA graph of `fn` (default: the fused launch), cold L2."""
        return bench_us(graphed(fn or self.fused))


def check(ours: Ours) -> dict:
    """Scores against the fp32 reference; indices (fused, and indexer + top-k apart) against the
    reference top-k of the scores they came with."""
    x = ours.x
    result = {}
    for name, fn in (("separate", ours), ("fused", ours.fused)):
        fn()
        n = int(x["lens"][0])
        ref_fn = indexer_fp8_ref if ours.fp8 else indexer_ref
        ref = ref_fn(x["q"], x["w"], ours.keys, x["table"], x["lens"])[:, :n]
        got = ours.scores[:, :n]
        result[f"{name}_score_rel_err"] = float((got.double() - ref.double()).norm() / ref.double().norm())
        want = topk_ref(ours.scores, x["lens"], K)
        result[f"{name}_topk_sets_equal"] = all(
            set(ours.idx[b].tolist()) == set(want[b].tolist()) for b in range(want.shape[0]))
    return result


def deep_gemm_attempt(x: dict) -> dict:
    """One attempt at DeepGEMM's fp8_paged_mqa_logits + torch.topk; the error is the result if it fails."""
    try:
        import deep_gemm
    except (ImportError, OSError, RuntimeError) as e:
        return {"status": "does not load", "error": repr(e)[:600]}
    try:
        batch = x["q"].shape[0]
        q8 = x["q"].to(torch.float8_e4m3fn).view(batch, 1, HEADS, DIM)
        kv = quantize_keys(x["keys"]).view(-1, PER_PAGE, 1, DIM + 4)
        ctx = x["lens"].clone()
        max_len = x["table"].shape[1] * PER_PAGE
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, PER_PAGE, sms)

        def run() -> torch.Tensor:
            logits = deep_gemm.fp8_paged_mqa_logits(q8, kv, x["w"], ctx, x["table"], meta, max_len, True)
            return torch.topk(logits, K, dim=1).indices

        run()
        return {"status": "ran", "us": bench_us(run)}
    except (RuntimeError, TypeError, ValueError, AttributeError) as e:
        return {"status": "loads but failed", "error": repr(e)[:600]}


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="indexer_topk")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lives", type=ints, default=[4096, 65536, 262144], help="live lengths L in tokens")
    parser.add_argument("--maxima", default="L,131072,1048576", help="configured maxima in tokens ('L' = L)")
    args = parser.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows, checks = [], {}
    for live in args.lives:
        maxima = sorted({live if m == "L" else int(m) for m in args.maxima.split(",")})
        for maximum in (m for m in maxima if m >= live):
            x = make_inputs(args.batch, live, maximum)
            for fp8 in (False, True):
                ours = Ours(x, fp8)
                if maximum == live:
                    checks[f"L={live // KI}K {'fp8' if fp8 else 'bf16'}"] = check(ours)
                key_bytes = args.batch * (live // 4) * (DIM + 4 if fp8 else 2 * DIM)
                row = {"L": f"{live // KI}K", "max": f"{maximum // KI}K", "keys": "fp8" if fp8 else "bf16",
                       "ours_us": ours.graph_us(), "separate_us": ours.graph_us(ours),
                       "indexer_us": ours.graph_us(ours.indexer), "topk_us": ours.graph_us(ours.topk)}
                if maximum == live and not fp8:  # the same measurement again: the run-to-run spread
                    row["ours_us_again"] = ours.graph_us()
                row["indexer_gbs"] = key_bytes / row["indexer_us"] / 1e3
                row["indexer_frac_copy"] = row["indexer_gbs"] / copy_gbs
                if not fp8:
                    row["torch_paged_us"] = bench_us(lambda: torch_scores_topk(x))
                    contiguous = contiguous_keys(x)
                    row["torch_contig_us"] = bench_us(lambda: torch_scores_topk(x, contiguous))
                    del contiguous
                rows.append(row)
                del ours
            del x
            torch.cuda.empty_cache()
    derived = derive(rows)
    payload = {"device": torch.cuda.get_device_name(),
               "copy_gbs": copy_gbs, "batch": args.batch, "k": K, "timing": "CUDA graph replay, cold L2, median",
               "checks": checks, "rows": rows, "derived": derived,
               "deep_gemm": deep_gemm_attempt(make_inputs(args.batch, 65536, 65536))}
    path = write_results("indexer_topk", payload, markdown(payload))
    print(f"copy {copy_gbs:.0f} GB/s; checks {checks}; deep_gemm {payload['deep_gemm']}; wrote {path}")
    ok = all(c[f"{m}_topk_sets_equal"] and c[f"{m}_score_rel_err"] < 2e-3 for c in checks.values()
             for m in ("separate", "fused"))
    return 0 if ok else 1


def derive(rows: list[dict]) -> list[dict]:
    """Per L (bf16): the max-context tax (time at the largest maximum / time at maximum = L), speedups."""
    out = []
    main = [r for r in rows if r["keys"] == "bf16"]
    for live in dict.fromkeys(r["L"] for r in main):
        same = [r for r in main if r["L"] == live]
        exact, largest = same[0], same[-1]
        out.append({"L": live, "largest_max": largest["max"],
                    "ours_tax": largest["ours_us"] / exact["ours_us"],
                    "torch_contig_tax": largest["torch_contig_us"] / exact["torch_contig_us"],
                    "x_vs_torch_contig_exact": exact["torch_contig_us"] / exact["ours_us"],
                    "x_vs_torch_paged_exact": exact["torch_paged_us"] / exact["ours_us"],
                    "x_vs_torch_contig_at_largest": largest["torch_contig_us"] / largest["ours_us"]})
    return out


def markdown(payload: dict) -> str:
    """The short results table committed beside the JSON."""
    us = lambda head, key: (head, key, ".1f")  # noqa: E731
    return "\n".join([
        f"# indexer + top-{payload['k']} on {payload['device']} (B = {payload['batch']})", "",
        f"{payload['timing']}; copy bandwidth measured in the same run: {payload['copy_gbs']:.0f} GB/s (read + write). "
        "ours = one fused launch; separate = indexer launch + top-k launch; torch = bmm scoring + torch.topk over the "
        "whole buffer, eager (contig: keys contiguous per request; paged: gathered through the page table first). "
        "Times in us.", "",
        *md_columns(payload["rows"], [("L", "L", ""), ("max", "max", ""), ("keys", "keys", ""), us("ours", "ours_us"),
                                      us("separate", "separate_us"), us("indexer", "indexer_us"), us("top-k", "topk_us"),
                                      ("indexer GB/s", "indexer_gbs", ".0f"), ("of copy", "indexer_frac_copy", ".0%"),
                                      us("torch contig", "torch_contig_us"), us("torch paged", "torch_paged_us")]), "",
        *md_columns(payload["derived"], [("L", "L", ""), ("ours tax (max 1M / max L)", "ours_tax", ".3f"),
                                         ("torch tax", "torch_contig_tax", ".1f"),
                                         ("x vs torch contig, max = L", "x_vs_torch_contig_exact", ".1f"),
                                         ("x vs torch paged, max = L", "x_vs_torch_paged_exact", ".1f"),
                                         ("x vs torch contig at max 1M", "x_vs_torch_contig_at_largest", ".1f")]),
        "", f"DeepGEMM fp8_paged_mqa_logits: {payload['deep_gemm']}", ""])
