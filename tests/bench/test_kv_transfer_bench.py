"""`bench/kv_transfer.py` end to end on the CPU: two real processes, real NIXL/UCX, the flash preset's pool layout.

Small sizes and a few repeats. Its numbers must be real: the bytes written into the decode pool equal the
request's pages' bytes (by the preset's own per-token formula), the decode side's pages hold exactly the prefill
side's bytes, every ratio is there and comes from measured times, UCX's log names the transport, no side outlives
the run. The UCX table parser and the checks' verdicts are tested on their own below.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from bench import kv_transfer, ucx_proto
from dsv4_cluster.workers.engine.presets import model_config

PAGE = 256


def _children(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (from /proc/*/stat; zombies do not count)."""
    out = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields and fields[0] != "Z" and int(fields[1]) == pid:
            out.add(int(entry.name))
    return out


PAGE_STATES = ["fresh", "churned", "scattered", "cache"]


@pytest.fixture(scope="module")
def all_states(tmp_path_factory) -> tuple[Path, Path, int, set[int]]:
    """One command over the four page states (what the GPU run does: a pair of sides per state, one JSON keyed by
    state, one table each): its output prefix, its logs folder, its exit status and the processes it left."""
    tmp = tmp_path_factory.mktemp("kvx")
    before = _children(os.getpid())
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NIXL_TELEMETRY_ENABLE", raising=False)   # the sides keep NIXL's telemetry only when asked to
        rc = kv_transfer.main(["--out", str(tmp / "kvx"), "--logs", str(tmp / "logs"), "--sizes", "1024,2048",
                               "--repeats", "3", "--warmup", "1", "--page-size", str(PAGE), "--timeout-s", "90",
                               "--pages", ",".join(PAGE_STATES), "--churn-cycles", "300"])
    return tmp / "kvx", tmp / "logs", rc, _children(os.getpid()) - before


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pages", PAGE_STATES)
def test_the_benchmark_moves_the_pages_bytes_and_reports_every_ratio(all_states, pages):
    out, logs, rc, left = all_states
    assert rc == 0
    assert left == set()           # every side exited (or was killed) with the run
    report = json.loads(out.with_suffix(".json").read_text())[pages]
    pool = report["pool"]
    page_bytes = pool["page_bytes"]
    assert pool["layout"]["page_size"] == PAGE and pool["buffer_dtypes"] == ["float32"]   # the CPU engine's rows
    assert len(pool["buffer_page_bytes"]) == pool["buffers"] >= 2 * model_config("flash").n_layers  # main, comp (+ keys)
    assert sum(pool["buffer_page_bytes"]) == page_bytes
    assert [r["tokens"] for r in report["sizes"]] == [1024, 2048]
    for r in report["sizes"]:
        assert r["pages"] == r["tokens"] // PAGE and r["bytes"] == r["pages"] * page_bytes
        c = r["checks"]
        assert c["engine_written_bytes"] == r["bytes"] == c["raw_written_bytes"]   # counted in the decode pool
        assert c["engine_contents_equal"] and c["raw_contents_equal"] and c["copy_contents_equal"] and c["ok"]
        # a fresh pool's allocator gives one run: one descriptor per region (transfer.page_runs); a scattered
        # pool's pages are one-page runs: a descriptor per page; a churned (or cache) pool's, a few
        both = r["page_runs"]["both"]
        if pages == "scattered":
            assert both == r["pages"] and r["run_lengths"] == {"src": [1] * both, "dst": [1] * both}
        elif pages == "fresh":
            assert r["page_runs"] == {"src": 1, "dst": 1, "both": 1}
            assert r["run_lengths"] == {"src": [r["pages"]], "dst": [r["pages"]]}
        else:
            assert sum(r["run_lengths"]["src"]) == sum(r["run_lengths"]["dst"]) == r["pages"]
        assert r["descriptors"] == {"engine": both * report["pool"]["regions"], "raw": 1}
        for m in ("engine", "raw", "copy"):
            s = r[m]
            assert s["n"] == 3 and 0 < s["p50_ms"] <= s["p99_ms"]
            assert s["gb_s"] == pytest.approx(r["bytes"] / (s["p50_ms"] / 1e3) / 1e9, rel=1e-2)
        for k in ("engine_vs_raw", "engine_vs_copy"):
            assert math.isfinite(r["ratios"][k]) and r["ratios"][k] > 0
        assert r["ratios"]["engine_vs_raw"] == pytest.approx(r["engine"]["gb_s"] / r["raw"]["gb_s"], rel=1e-2)
    assert report["ucx"]["engine"]["put_transports"] and report["ucx"]["raw"]["put_transports"]
    assert report["ucx"]["engine"]["peer_lanes"]
    assert report["target"]["met"] is None                    # no size >= 8K measured
    first = report["sizes"][0]["ratios"]["engine_vs_raw"]          # the 1024-token row
    assert report["target"]["small_engine_vs_raw"] == first and report["target"]["small_met"] == (first >= 0.5)
    state = pool["state"]["prefill"]
    assert state["pages"] == pages and state["free_pages"] + state["held_pages"] == pool["layout"]["num_pages"]
    if pages in ("churned", "cache"):      # held at --occupancy (0.9), or a prefix cache's pages after 300 turns
        assert state["churn_cycles"] == 300 and 0.8 <= state["occupancy"] <= 0.95, state
        decode = pool["state"]["decode"]
        assert decode["pages"] == pages and 0.85 <= decode["occupancy"] <= 0.9, decode
    assert (logs / pages / "prefill.log").exists() and (logs / pages / "decode.log").exists()


UCX_LOG = """\
[1796312985.3] [vm:6028 :0]      ucp_worker.c:1997 UCX  INFO    kvx-prefill intra-node cfg#1 rma_am(tcp/lo)
[1796312985.3] [vm:6028 :0]   +--------+-------------+-----------------------------------+
[1796312985.3] [vm:6028 :0]   | kvx-prefill self cfg#0                                   |
[1796312985.3] [vm:6028 :0]   | remote memory write by ucp_put* from host memory to host |
[1796312985.3] [vm:6028 :0]   | Range  | Description |              Config               |
[1796312985.3] [vm:6028 :0]   | 0..inf | zero-copy   | posix/memory                      |
[1796312985.4] [vm:6028 :0]   | kvx-prefill intra-node cfg#1                             |
[1796312985.4] [vm:6028 :0]   | remote memory write by ucp_put* from cuda memory to cuda |
[1796312985.4] [vm:6028 :0]   +--------+-------------+-----------------------------------+
[1796312985.4] [vm:6028 :0]   | Range  | Description |              Config               |
[1796312985.4] [vm:6028 :0]   | 0..8K  | short       | cuda_copy/cuda                    |
[1796312985.4] [vm:6028 :0]   | 8K..inf | zero-copy  | 50% on cuda_ipc/cuda and 50% on rc_mlx5/mlx5_0:1 |
[1796312985.4] [vm:6028 :0]   | kvx-prefill intra-node cfg#1                             |
[1796312985.4] [vm:6028 :0]   | active message by ucp_am_send* from host memory          |
[1796312985.4] [vm:6028 :0]   | 0..inf | zero-copy   | tcp/lo                            |
"""


def test_ucx_tables_give_the_put_transports_towards_the_peer(tmp_path):
    tables = ucx_proto.parse_tables(UCX_LOG)
    assert [(t["scope"], t["op"][:19]) for t in tables] == [("self", "remote memory write"),
                                                            ("intra-node", "remote memory write"),
                                                            ("intra-node", "active message by u")]
    assert tables[1]["from_mem"] == "cuda" and tables[1]["rows"][1]["description"] == "zero-copy"
    # self (loopback within the agent) and active messages are not what a WRITE to the peer used
    assert ucx_proto.put_transports(tables, "kvx-prefill") == ["cuda_copy/cuda", "cuda_ipc/cuda", "rc_mlx5/mlx5_0:1"]
    log = tmp_path / "p.log"
    log.write_text(UCX_LOG)
    summary = ucx_proto.summarize([log], ["kvx-prefill", "kvx-raw-prefill"])
    assert summary["kvx-raw-prefill"] == {"put_transports": [], "put_tables": [], "peer_lanes": [],
                                          "device_lane": [], "carried_by": []}
    assert summary["kvx-prefill"]["peer_lanes"] == ["rma_am(tcp/lo)"]
    # per memory type: a VRAM -> VRAM WRITE takes the cuda -> cuda table, a DRAM one the host -> host table
    assert ucx_proto.put_transports(tables, "kvx-prefill", "cuda") == ["cuda_copy/cuda", "cuda_ipc/cuda",
                                                                      "rc_mlx5/mlx5_0:1"]
    assert ucx_proto.put_transports(tables, "kvx-prefill", "host") == []


def test_without_a_cuda_put_table_the_device_lane_says_what_carried_gpu_memory(tmp_path):
    # what UCX 1.23 printed on the H200 (two processes on GPU 0): put tables host -> host and host -> cuda only
    log = tmp_path / "p.log"
    log.write_text("""\
[1.0] [vm:594  :0]   | kvx-prefill intra-node cfg#2                             |
[1.0] [vm:594  :0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [vm:594  :0]   | Range  | Description |              Config               |
[1.0] [vm:594  :0]   | 0..inf | zero-copy   | cma/memory                        |
[1.0] [vm:594  :0]   | kvx-prefill intra-node cfg#2                             |
[1.0] [vm:594  :0]   | remote memory write by ucp_put* from host memory to cuda/dev[1] |
[1.0] [vm:594  :0]   | Range  | Description |              Config               |
[1.0] [vm:594  :0]   | 0..inf | software emulation | tcp/lo                     |
[1.1] [vm:594  :0]      ucp_worker.c:1997 UCX  INFO    kvx-prefill intra-node cfg#2 rma_am(tcp/lo)  amo_am(tcp/lo)  \
device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  ka(tcp/lo)
""")
    gpu = ucx_proto.summarize([log], ["kvx-prefill"], "cuda")["kvx-prefill"]
    assert gpu["put_transports"] == [] and gpu["device_lane"] == ["cuda_ipc/cuda"]
    assert gpu["carried_by"] == ["cuda_ipc/cuda"]
    host = ucx_proto.summarize([log], ["kvx-prefill"], "host")["kvx-prefill"]
    assert host["put_transports"] == host["carried_by"] == ["cma/memory"]


def _raw_result(written: int, equal: bool) -> dict:
    t = {k: [0.001, 0.002] for k in ("engine", "engine_done", "raw", "raw_done", "copy")}
    checks = {"engine_written_bytes": written, "engine_contents_equal": equal, "raw_written_bytes": 1000,
              "raw_contents_equal": True, "copy_contents_equal": True}
    return {"sizes": [{"tokens": 64, "pages": 1, "bytes": 1000, "descriptors": {"engine": 12, "raw": 1},
                       "page_runs": {"src": 1, "dst": 1, "both": 1}, "run_lengths": {"src": [1], "dst": [1]},
                       "times_s": t, "checks": checks}]}


@pytest.mark.parametrize("written,equal,ok", [(1000, True, True), (999, True, False), (2000, True, False),
                                              (1000, False, False)])
def test_a_size_whose_bytes_or_contents_differ_fails_its_checks(written, equal, ok):
    assert kv_transfer.summarize(_raw_result(written, equal))[0]["checks"]["ok"] is ok


@pytest.mark.parametrize("argv,message", [
    (["--prefill-device", "gpu1"], "--prefill-device 'gpu1': give cpu or cuda:N"),
    (["--preset", "huge"], "--preset 'huge': choose from tiny, flash"),
    (["--page-size", "6"], "page_size 6 must be a multiple of the compression ratio 4"),
    (["--sizes", "1024", "--pool-pages", "2"], "--pool-pages 2: the largest request needs 4 pages"),
    (["--max-tokens", "512"], "leave no request size to measure"),
    (["--pages", "fresh,hot"], "--pages fresh,hot: choose from fresh, churned, scattered, cache"),
    (["--occupancy", "1"], "--occupancy 1.0: give a share of the pool in (0, 1)"),
])
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        kv_transfer.parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_one_command_writes_one_report_and_one_table_per_state_in_order(all_states):
    out, _, rc, _ = all_states
    assert rc == 0
    reports = json.loads(out.with_suffix(".json").read_text())
    assert list(reports) == PAGE_STATES
    assert [r["config"]["pages"] for r in reports.values()] == PAGE_STATES
    md = out.with_suffix(".md").read_text()
    assert md.count("UCX transports of the WRITEs") == 4 and md.count("| 2048 |") == 4 and "FAILED" not in md
    assert [line.split("pages: ")[1].split(",")[0] for line in md.splitlines() if "pages: " in line] == PAGE_STATES
    for state in PAGE_STATES:   # without --nixl-telemetry none of it is recorded
        assert all("engine_nixl_telemetry" not in r for r in reports[state]["sizes"])
    assert "NIXL telemetry" not in md


@pytest.mark.timeout(120)
def test_nixl_telemetry_of_every_timed_write_is_kept_and_tabled_when_asked_for(tmp_path):
    """--nixl-telemetry: each timed engine and raw WRITE's NIXL post and xfer durations and descriptor count, read
    before the handle goes (the engine's through NixlTransfer.poll's hook); without it, none of that is recorded
    (the four-state run above)."""
    out = tmp_path / "kvx"
    rc = kv_transfer.main(["--out", str(out), "--sizes", "1024", "--repeats", "3", "--warmup", "1",
                           "--timeout-s", "90", "--nixl-telemetry"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    row, md = report["sizes"][0], out.with_suffix(".md").read_text()
    for m, descs in (("engine", report["pool"]["regions"]), ("raw", 1)):   # a fresh pool: one run, merged
        t = row[f"{m}_nixl_telemetry"]
        assert t["n"] == 3 and t["descs"] == [descs] and 0 <= t["post_us_p50"] <= t["xfer_us_p50"]
    assert "NIXL telemetry (NIXL_TELEMETRY_ENABLE=y), p50 us:" in md and md.count("| 1024 |") == 2


@pytest.mark.timeout(120)
def test_a_side_that_fails_ends_the_run_with_its_log_and_leaves_no_process(tmp_path, capsys):
    """UCX refuses a transport that does not exist: both sides fail to start their NIXL agents."""
    before = _children(os.getpid())
    rc = kv_transfer.main(["--out", str(tmp_path / "kvx"), "--sizes", "1024", "--repeats", "1",
                           "--ucx-tls", "no_such_transport", "--timeout-s", "90"])
    assert rc == 1
    err = capsys.readouterr().err
    assert re.search("the (prefill|decode) side exited with 1", err) and "no_such_transport" in err
    assert _children(os.getpid()) - before == set()
    assert not (tmp_path / "kvx.json").exists()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode_device", ["cuda:0", "cuda:1"])
def test_on_gpus_the_pages_move_vram_to_vram_over_cuda_ipc(tmp_path, decode_device):
    """Two processes on GPU 0 (or GPU 0 -> GPU 1): the checks hold and UCX's log names cuda_ipc for the engine's
    WRITE (on the H200: `pytest tests/bench/test_kv_transfer_bench.py -m gpu`)."""
    import torch

    if torch.cuda.device_count() < int(decode_device[-1]) + 1:
        pytest.skip(f"needs {decode_device}")
    out = tmp_path / "kvx"
    rc = kv_transfer.main(["--out", str(out), "--sizes", "1024,8192", "--repeats", "5", "--timeout-s", "240",
                           "--prefill-device", "cuda:0", "--decode-device", decode_device])
    report = json.loads(out.with_suffix(".json").read_text())
    assert rc == 0 and all(r["checks"]["ok"] for r in report["sizes"])
    assert report["pool"]["device_names"][0].startswith("NVIDIA")
    engine_ucx = report["ucx"]["engine"]
    assert "cuda_ipc/cuda" in engine_ucx["carried_by"], engine_ucx
