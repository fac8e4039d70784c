"""The scale-out benchmark (bench/scaleout.py) at CI size: 2 prefill x 2 decode modeled stubs, a few sessions, our
`prefix` and `round_robin`, SGLang's gateways' `cache_aware` (sglang-router 0.3.2, smg 1.13.0) with their sanity
probes, and the floor relay: the numbers must be real and consistent (every
request served by one prefill and one decode of its pair, hit rates from the stubs' own counts, router-added latency
inside the TTFT), never a timing threshold. Plus the stubs' prefix cache on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.stubs import PAGE_TOKENS, Prefill, page_names, prompt_of, tokens_of

SESSIONS, TURNS = 4, 3
ROUTERS = ("prefix", "round_robin", "rust", "smg", "floor")
REPO = Path(__file__).resolve().parents[2]  # `python -m bench.scaleout` runs from a checkout's root


def test_the_stub_prefix_cache_matches_whole_leading_pages_and_evicts_leaves_first():
    a = page_names(["a"] * 3 * PAGE_TOKENS + ["tail"])     # 3 whole pages, the partial tail is not a page
    assert len(a) == 3 and page_names(["a"] * 2 * PAGE_TOKENS) == a[:2]
    cache = Prefill(0, capacity=4)
    assert cache.match(a) == 0
    cache.insert(a)
    assert cache.match(a) == 3 and cache.match(page_names(["a"] * 2 * PAGE_TOKENS + ["b"] * PAGE_TOKENS)) == 2
    b = page_names(["b"] * 3 * PAGE_TOKENS)
    cache.insert(b)                                        # 6 pages into 4: a's two deepest go, its root stays
    assert len(cache.pages) == 4 and cache.match(b) == 3 and cache.match(a) == 1
    assert PAGE_TOKENS * cache.match(b) == 48


def test_the_stubs_tokenize_a_chat_template_of_their_own_not_the_routers_blocks():
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there [id:x]"}]}
    text = prompt_of(body)
    assert text.startswith("<|begin|><|system|>") and text.endswith("<|assistant|>\n") and "<system>" not in text
    assert tokens_of("Wonderfully, 42!") == ["Wonder", "fully", ",", " ", "4", "2", "!"]


def test_scaleout_benchmark_at_ci_size(tmp_path):
    cmd = [sys.executable, "-m", "bench.scaleout", "--n", "2", "--concurrency", "2", "--sessions",
           str(SESSIONS), "--turns", str(TURNS), "--think-ms", "0", "--plain-loopback", "--out", str(tmp_path),
           "--routers", *ROUTERS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "scaleout.json").read_text())
    rows = {r["router"]: r for r in result["rows"]}
    assert set(rows) == set(ROUTERS)
    for name, r in rows.items():
        assert r["n"] == 2 and r["errors"] == 0, (name, r["first_errors"], r["stub_errors"])
        assert r["requests"] == SESSIONS * TURNS
        assert r["prefill_requests"] == r["decode_requests"] == r["requests"], name    # one pair per request
        assert r["mispaired"] == 0 and r["unrecorded"] == 0 and r["stub_errors"] == [], name
        assert 0 < r["cached_tokens"] < r["prompt_tokens"], name    # later turns resend cached history
        assert r["hit_rate"] == round(r["cached_tokens"] / r["prompt_tokens"], 4)
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 <= r["added_p50_ms"] <= r["ttft_p50_ms"] and r["added_p50_ms"] <= r["added_p99_ms"]
        # /proc counts CPU in clock ticks (10 ms): at CI size a cell's router may use less than one tick
        assert r["cpu_ms_per_request"] >= 0 and r["requests_per_s"] > 0
    # the prefix policy keeps each session on the prefill that holds its history: every later turn finds at least
    # the whole pages of the turn before (the first turn of each session pays in full, minus the system prompt)
    assert rows["prefix"]["hit_rate"] >= rows["round_robin"]["hit_rate"]
    assert rows["prefix"]["sanity"]["passed"] and not rows["prefix"].get("invalid")      # one prefill for the session
    assert rows["prefix"]["rss_mb_before"] > 0 and rows["prefix"]["rss_mb_after"] > 0
    assert rows["round_robin"]["sanity"] is None                                           # not prefix-aware: no probe
    # each gateway as run says what it is (both packages install a `smg` script; the last installed owns it), and
    # smg's cache_aware keeps a lone session on one prefill where sglang-router 0.3.2's PD mode picks at random
    assert result["anchors"] == {"rust": "sglang-router 0.3.2", "smg": "smg 1.13.0"}
    assert rows["smg"]["sanity"]["passed"], rows["smg"]["sanity"]
    for anchor in ("rust", "smg"):                         # a failed probe marks the row invalid, and says where
        check = rows[anchor]["sanity"]
        assert check["passed"] == (len(set(check["prefills"])) == 1) != bool(rows[anchor].get("invalid"))
    table = (tmp_path / "scaleout.md").read_text()
    assert all(f"| 2 | {name}" in table for name in rows) and "The targets (same run):" in table
