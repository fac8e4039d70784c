"""The scale-out benchmark's numbers: one row per router and N from the client's results and the stubs' records,
and the markdown table with the ratios and the issue's targets, all from one run."""

from __future__ import annotations

from .scaleout_load import Result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of `values` (q in 0..100); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def cell_row(name: str, n: int, concurrency: int, results: list[Result], stubs: dict, wall_s: float,
             cpu_s: float) -> dict:
    """One router at one N: latency at the client, hit rate at the stubs, router-added latency per request."""
    ok = [r for r in results if r.status == 200 and r.error is None and r.first is not None]
    ok_ids = {id(r) for r in ok}
    records = stubs["records"]
    ttft, added, unrecorded = [], [], 0
    for r in ok:
        ttft.append(r.ttft_s * 1e3)
        rec = records.get(r.user, {})
        if not {"prefill_arrival", "decode_arrival", "first_token"} <= rec.keys():
            unrecorded += 1
            continue
        stub_part = rec["first_token"] - min(rec["prefill_arrival"], rec["decode_arrival"])
        added.append((r.ttft_s - stub_part) * 1e3)
    prompt = sum(p["prompt_tokens"] for p in stubs["prefill"])
    cached = sum(p["cached_tokens"] for p in stubs["prefill"])
    served = [p["requests"] for p in stubs["prefill"]]
    return {
        "router": name, "n": n, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "first_errors": sorted({r.error or f"status {r.status}" for r in results if id(r) not in ok_ids})[:3],
        "wall_s": round(wall_s, 3), "requests_per_s": round(len(results) / wall_s, 1),
        "ttft_p50_ms": round(percentile(ttft, 50), 3), "ttft_p99_ms": round(percentile(ttft, 99), 3),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0, "prompt_tokens": prompt, "cached_tokens": cached,
        "added_p50_ms": round(percentile(added, 50), 3), "added_p99_ms": round(percentile(added, 99), 3),
        "cpu_ms_per_request": round(cpu_s * 1e3 / max(1, len(results)), 3),
        "prefill_requests": sum(served), "decode_requests": sum(stubs["decode_requests"].values()),
        "prefills_used": sum(1 for s in served if s), "busiest_prefill_share": round(max(served) / max(1, sum(served)), 3),
        "unrecorded": unrecorded, "mispaired": stubs["mispaired"], "stub_errors": stubs["errors"],
    }


def _targets(rows: list[dict]) -> list[str]:
    by = {(r["n"], r["router"]): r for r in rows}
    lines = []
    for n in sorted({r["n"] for r in rows}):
        p, rr, ca = by.get((n, "prefix")), by.get((n, "round_robin")), by.get((n, "cache_aware"))
        if p is None:
            continue
        parts = []
        if ca is not None:
            parts.append(f"prefix hit rate {p['hit_rate']:.3f} vs cache_aware {ca['hit_rate']:.3f} "
                         f"({'met' if p['hit_rate'] >= ca['hit_rate'] else 'missed'} where N >= 8)"
                         if n >= 8 else f"prefix hit rate {p['hit_rate']:.3f} vs cache_aware {ca['hit_rate']:.3f}")
            parts.append(f"TTFT p50 prefix / cache_aware {p['ttft_p50_ms'] / ca['ttft_p50_ms']:.2f}x")
        if rr is not None:
            ratio = p["ttft_p50_ms"] / rr["ttft_p50_ms"]
            parts.append(f"TTFT p50 prefix / round_robin {ratio:.2f}x"
                         + (f" (target <= 0.5x: {'met' if ratio <= 0.5 else 'missed'})" if n >= 8 else ""))
        if n >= 64:
            floor = by.get((n, "floor"))
            parts.append(f"router-added p50 {p['added_p50_ms']:.3f} ms (target <= 1 ms at c = 64: "
                         f"{'met' if p['added_p50_ms'] <= 1.0 else 'missed'}"
                         + (f"; the floor relay's {floor['added_p50_ms']:.3f} ms" if floor else "") + ")")
        lines.append(f"- N = {n}: " + "; ".join(parts))
    return lines


def markdown(result: dict) -> str:
    rows = result["rows"]
    w, m = result["workload"], result["model"]
    out = ["# Scale-out benchmark", "", "`python -m bench.scaleout`", "",
           f"N prefill x N decode SGLang-modeled stubs (one process); {w['sessions']} sessions x {w['turns']} turns, "
           f"a {w['system_chars']}-char system prompt shared by all, {w['first_chars']} chars of first user message, "
           f"{w['turn_chars']} more per turn, {w['max_tokens']} tokens out; concurrency {result['concurrency']} "
           f"(closed loop). Prefill {m['base_ms']:g} ms + {m['per_token_us']:g} us per uncached token (4 chars), "
           f"FIFO; prefix cache {m['cache_tokens']:,} tokens per prefill (LRU, 16-token pages); decode "
           f"{m['token_ms']:g} ms per token. Routers: ours with `prefill_policy` prefix / round_robin "
           f"(decode round_robin), SGLang's Rust router (sglang-router) `--prefill-policy cache_aware "
           f"--decode-policy round_robin`, defaults otherwise.", "",
           "| N | router | requests | req/s | TTFT p50 / p99 ms | hit rate | router-added p50 / p99 ms "
           "| router CPU ms/req | prefills used (busiest share) | errors | load 1m |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['n']} | {r['router']} | {r['requests']} | {r['requests_per_s']:,.1f} | "
                   f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['hit_rate']:.3f} | "
                   f"{r['added_p50_ms']:.2f} / {r['added_p99_ms']:.2f} | {r['cpu_ms_per_request']:.2f} | "
                   f"{r['prefills_used']} ({r['busiest_prefill_share']:.2f}) | {r['errors']} | "
                   f"{r['load_average_1m']:.1f} |")
    out += ["", "Ratios and the issue's targets (same run):", "", *_targets(rows), "",
            f"{result['cpus']} CPUs shared with other work; 1-min load average {result['load_average_before'][0]:.1f} "
            f"before, {result['load_average_after'][0]:.1f} after; loopback: {result['loopback']}. Router-added: "
            "client TTFT minus the stubs' part (first leg's arrival to the decode's first token). Hit rate: cached "
            "/ prompt tokens over all prefills, as the stubs count them. Router CPU includes its health checks.", ""]
    return "\n".join(out)
