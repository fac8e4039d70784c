"""Which of SGLang's sparse-decode calls the plugin runs on our kernels, and which it leaves on SGLang's own call.

The rule: never slower (docs/sglang.md, "Never slower: the decode route table", has the table and what was
measured). The table is data, derived from a committed benchmark (`routes_from_results` over
bench/results/sglang_decode.json; a CI test checks that the two agree), and what it says is what runs: the routed
call reads it per call, from shapes only (graph-capturable: a captured graph holds whichever kernel its shapes chose).

Routes: "ours" (our kernel told the real head count: the dispatch table's row for it), "ours_all_heads" (our kernel
computing all 64 heads: at 16 real heads on sm_90 the 64-head Gluon kernel beats the 16-head one at some B),
"stock". Between two measured batch sizes a call takes ours only when both neighbours are ours (the same route);
past the largest measured batch, the largest's route; a batch in no measured class, stock.
"""

from __future__ import annotations

import bisect
import functools

KINDS = ("window", "c4", "c128")
EXTRA_PAGE_KIND = {64: "c4", 2: "c128"}  # tokens per page of the extra cache SGLang passes -> layer kind
MEASURED_ON = {"sm_90": "H100 (sm_90, as the H200), Triton 3.8.0, torch 2.11, CUDA-graph replay, cold L2, vs FlashMLA "
                        "(sgl-flash-mla 1.0.0) as SGLang 0.5.23 calls it: bench/results/sglang_decode.json",
               "sm_100": "not measured: stock",
               "sm_120": "H100 standing in for sm_120 (mma.sync, 99 KB), vs SGLang's sm_120 Triton kernel: "
                         "bench/results/sm120_decode.json; FlashInfer's sm_120 kernel not measurable there"}

# (class, layer kind, real heads) -> ((batch, route), ...) over the measured batches.
ROUTES: dict[tuple[str, str, int], tuple[tuple[int, str], ...]] = {
    ("sm_90", "window", 64): ((1, "stock"), (8, "stock"), (32, "stock"), (64, "ours"), (128, "ours"), (256, "ours")),
    ("sm_90", "window", 16): ((1, "ours"), (8, "ours"), (32, "ours"), (64, "ours"), (128, "ours"), (256, "ours")),
    ("sm_90", "c4", 64): ((1, "stock"), (8, "stock"), (32, "stock"), (64, "ours"), (128, "stock"), (256, "stock")),
    ("sm_90", "c4", 16): ((1, "ours"), (8, "ours"), (32, "ours"), (64, "ours"), (128, "ours"), (256, "ours")),
    ("sm_90", "c128", 64): ((1, "stock"), (8, "stock"), (32, "stock"), (64, "ours"), (128, "stock"), (256, "stock")),
    ("sm_90", "c128", 16): ((1, "ours"), (8, "ours"), (32, "ours"), (64, "ours"), (128, "ours"), (256, "ours")),
}
ALWAYS = {"sm_120": "ours", "sm_100": "stock"}


def layer_kind(extra_k_cache) -> str:
    """The layer kind of a decode call from its extra cache: none = window-only; 64-token pages = ratio 4;
    2-token pages = ratio 128 (SGLang 0.5.23's page sizes)."""
    if extra_k_cache is None:
        return "window"
    return EXTRA_PAGE_KIND.get(int(extra_k_cache.shape[1]), "c4")


@functools.lru_cache(maxsize=1)
def unmeasured_build() -> str | None:
    """Why this process's kernels are not the ones ROUTES measured (None: they are). ROUTES' "ours" is the Gluon
    kernels' (wgmma at 64 heads; at 16, wgmma from B = 32 and mma.sync below), which run only on the Triton release
    they were written for; on another, the Triton kernels would run in their place, measured slower than FlashMLA at
    most of those calls."""
    from .sparse_mla_decode.config import gluon_api_unavailable

    return gluon_api_unavailable()


def route(gpu: str, kind: str, real_heads: int, batch: int) -> str:
    """"ours", "ours_all_heads" or "stock" for one call (see the module docstring); on a class the table measured,
    every call stock where this build's kernels are not the measured ones (`unmeasured_build`)."""
    if gpu in ALWAYS:
        return ALWAYS[gpu]
    if unmeasured_build() is not None:
        return "stock"
    points = _points(gpu, kind, real_heads)
    if not points:
        return "stock"
    batches = [b for b, _ in points]
    i = bisect.bisect_left(batches, batch)
    if i < len(points) and batches[i] == batch:  # a measured batch
        return points[i][1]
    if i == len(points):  # past the largest
        return points[-1][1]
    if i == 0:  # below the smallest
        return "stock"
    below, above = points[i - 1][1], points[i][1]
    return below if below == above else "stock"


def _points(gpu: str, kind: str, real_heads: int) -> tuple[tuple[int, str], ...]:
    """The measured (batch, route) points of a call: the table's 64-head row above 16 real heads, else its 16."""
    return ROUTES.get((gpu, kind, 64 if real_heads > 16 else 16), ())


def _ours_at(points, mark_all_heads: bool = False) -> list[str]:
    """The measured batches of `points` where ours runs (marked where it computes all 64 heads)."""
    return [f"{b}" + (" (all 64 heads)" if mark_all_heads and r == "ours_all_heads" else "")
            for b, r in points if r != "stock"]


def describe(gpu: str) -> dict[str, str]:
    """Per call (layer kind / real heads) of class `gpu`: where ours runs and where stock does, and why."""
    if gpu in ALWAYS:
        return {"all calls": f"{ALWAYS[gpu]} ({MEASURED_ON[gpu]})"}
    if (why := unmeasured_build()) is not None:
        return {"all calls": f"stock: the table was measured with the Gluon kernels, which cannot run here: {why} "
                             f"({MEASURED_ON[gpu]})"}
    out = {}
    for (g, kind, heads), points in ROUTES.items():
        if g != gpu:
            continue
        ours = _ours_at(points, mark_all_heads=True)
        out[f"{kind} / {heads} heads"] = (f"ours at B = {', '.join(ours)}; " if ours else "") + \
            f"stock elsewhere (ours measured < 1.0x or not measured; {MEASURED_ON[gpu]})"
    return out


def summary(gpu: str, real_heads: int) -> str:
    """One line for `plan` / `status`: where ours runs at `real_heads` on class `gpu` (the rest: SGLang's stock)."""
    if gpu in ALWAYS:
        return f"{ALWAYS[gpu]} on every call"
    parts = []
    for kind in KINDS:
        ours = _ours_at(_points(gpu, kind, real_heads))
        parts.append(f"{kind} B={','.join(ours)}" if ours else f"{kind} -")
    return "ours at " + "; ".join(parts) + "; else stock"


def routes_from_results(rows: list[dict], gpu: str = "sm_90") -> dict[tuple[str, str, int], tuple[tuple[int, str], ...]]:
    """The ROUTES rows a benchmark run gives (bench/sglang_decode.py rows): per kind, real heads and B, the faster
    of our call at the real head count ("ours") and, at 16 real heads, our call computing all 64 ("ours_all_heads")
    where it is >= 1.0x FlashMLA, else "stock"."""
    speed = {(r["layer"], r["real_heads"], r["B"], r["impl"]): r["speedup_vs_flashmla"]
             for r in rows if r.get("bench") == "decode"}
    table = {}
    for kind in KINDS:
        for heads, told in ((64, "adapter"), (16, "adapter_h16")):
            batches = sorted({b for (k, h, b, _) in speed if k == kind and h == heads})
            points = []
            for b in batches:
                mine = speed.get((kind, heads, b, told), 0.0)
                all_heads = speed.get((kind, 64, b, "adapter"), 0.0) if heads == 16 else 0.0
                best, name = max((mine, "ours"), (all_heads, "ours_all_heads"))
                points.append((b, name if best >= 1.0 else "stock"))
            if points:
                table[(gpu, kind, heads)] = tuple(points)
    return table
