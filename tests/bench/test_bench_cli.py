"""`dsv4-cluster bench URL` against a real cluster: `examples/local.yaml` (on free ports) brought up by the CLI.

A small sweep (concurrency 1 and 3, a few requests each): every request succeeds with exactly `max_tokens`
tokens, the timings are there, the table and the progress lines are printed, the JSON is written; a wrong model
name is counted as errors under the router's own reason and exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.load import relocated
from dsv4_cluster.orchestrator.load.loadgen import percentile

from bench.local_cluster import LocalCluster, run_cli

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local.yaml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    topology, url = relocated(EXAMPLE, tmp)
    c = LocalCluster(home=tmp / "home", topology=topology, ports={"router": int(url.rsplit(":", 1)[1])})
    with c.running():
        yield c


def test_bench_sweeps_the_local_cluster_and_prints_its_table(cluster, tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli(cluster.home, "bench", cluster.router_url, "--concurrency", "1,3", "--requests", "4",
                "--max-tokens", "8", "--prompt-chars", "120", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    sweep = json.loads(out.read_text())
    assert sweep["model"] == "dsv4-tiny"                                   # asked of /v1/models
    assert [lv["concurrency"] for lv in sweep["levels"]] == [1, 3]
    for lv in sweep["levels"]:
        assert (lv["requests"], lv["errors"], lv["errors_by_reason"]) == (4, 0, {})
        assert lv["output_tokens"] == 4 * 8
        assert lv["prompt_tokens_mean"] > 120                             # the prompt plus the chat template
        assert 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"]
        assert lv["ttft_p50_s"] < lv["e2e_p50_s"]    # each request's first token comes before its end (8 tokens)
        assert 0 < lv["tpot_p50_s"] <= lv["tpot_p99_s"]
        assert lv["output_tok_s"] > 0
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| concurrency | requests |") and len(lines) == 4
    assert lines[2].startswith("| 1 | 4 |") and lines[3].startswith("| 3 | 4 |")
    assert "[bench] concurrency 3: 4/4 done, 0 errors" in r.stderr      # the final progress line of a level


def test_bench_counts_refused_requests_by_reason(cluster):
    r = run_cli(cluster.home, "bench", cluster.router_url, "--concurrency", "2", "--requests", "3",
                "--max-tokens", "4", "--model", "no-such-model", timeout=120)
    assert r.returncode == 2, r.stderr + r.stdout
    row = r.stdout.splitlines()[2]
    assert row.startswith("| 2 | 3 |") and "HTTP 404" in row and "x3" in row, row


def test_bench_names_an_endpoint_that_does_not_answer(tmp_path):
    from dsv4_cluster.orchestrator.launch.ports import free_ports

    r = run_cli(tmp_path, "bench", f"http://127.0.0.1:{free_ports(1)[0]}", "--requests", "1", timeout=60)
    assert r.returncode == 1
    assert "no answer to GET /v1/models" in r.stderr


def test_percentile_is_nearest_rank():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == 5.0
    assert percentile([], 50) != percentile([], 50)                      # NaN
