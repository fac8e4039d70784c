"""Topology loading: the shipped layouts load resolved; broken files list every problem and exit 2."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_cluster.orchestrator.topology.load import (
    TopologyError,
    UnknownNameError,
    load_topology,
    main,
    parse_topology,
    topology_from_data,
)

from tests.topology_fixtures import BASE, SGLANG, check, edit, line_of, problems

REPO = Path(__file__).resolve().parents[2]


# --- the shipped layouts ---------------------------------------------------------------------

def test_production_topology_loads_resolved() -> None:
    topo = load_topology(REPO / "topology.yaml")
    assert (topo.engine, topo.model.path, topo.model.context_length) == ("sglang", "deepseek-ai/DeepSeek-V4-Flash", 131072)
    prefill, decode = topo.worker("prefill-0"), topo.worker("decode-0")
    assert (prefill.role, prefill.device, prefill.gpus, prefill.tp, prefill.numa_node) == ("prefill", "cuda", [0, 1, 2, 3], 4, 0)
    assert (prefill.port, prefill.nccl_port, prefill.bootstrap_port) == (30100, 30110, 8998)
    assert (decode.role, decode.gpus, decode.tp, decode.numa_node) == ("decode", [4, 5, 6, 7], 4, 1)
    assert (decode.port, decode.nccl_port, decode.bootstrap_port) == (30200, 30210, None)
    assert all((w.page_size, w.kv_cache_dtype, w.node) == (256, "fp8_e4m3", "local") for w in topo.workers)
    assert (topo.router.host, topo.router.port, topo.transfer.backend) == ("0.0.0.0", 30001, "nixl")
    assert topo.kernels.sparse_mla_decode and topo.kernels.indexer and topo.kernels.topk
    assert topo.source == (REPO / "topology.yaml").absolute()


def test_local_example_loads_resolved() -> None:
    topo = load_topology(REPO / "examples" / "local.yaml")
    assert (topo.engine, topo.model.name, topo.model.seed, topo.model.context_length) == ("embedded", "dsv4-tiny", 0, 2048)
    assert [(w.name, w.role) for w in topo.workers] == [("prefill-0", "prefill"), ("decode-0", "decode")]
    assert all((w.device, w.page_size, w.kv_cache_dtype, w.max_total_tokens) == ("cpu", 16, "auto", 16384)
               for w in topo.workers)
    assert topo.router.port == 30001 and topo.node("local").address == "127.0.0.1"
    assert topo.run_dir_path == (REPO / "examples" / ".dsv4-cluster").resolve()


def test_round_trips_through_data_and_pickle() -> None:
    topo = load_topology(REPO / "topology.yaml")
    again = topology_from_data(topo.model_dump(), source=topo.source)
    assert again == topo and again.run_dir_path == topo.run_dir_path
    unpickled = pickle.loads(pickle.dumps(topo))  # Ray ships it to the supervisor actors
    assert unpickled == topo and unpickled.source == topo.source


def test_lookups_name_what_exists() -> None:
    topo = parse_topology(BASE)
    assert topo.source is None and topo.run_dir_path == (Path.cwd() / ".dsv4-cluster").resolve()
    with pytest.raises(UnknownNameError, match="no worker named 'decode-9'.*prefill-0, decode-0"):
        topo.worker("decode-9")
    with pytest.raises(UnknownNameError, match="no node named 'gpu-host'.*local"):
        topo.node("gpu-host")


def test_worker_value_overrides_default_and_absolute_run_dir(tmp_path: Path) -> None:
    text = edit(BASE, "    port: 30200\n", "    port: 30200\n    max_total_tokens: 4096\n")
    text += f"cluster:\n  run_dir: {tmp_path / 'state'}\n"
    topo = parse_topology(text, source=tmp_path / "elsewhere" / "t.yaml")
    assert topo.worker("decode-0").max_total_tokens == 4096 and topo.worker("prefill-0").max_total_tokens == 16384
    assert topo.run_dir_path == tmp_path / "state"


def test_from_data_runs_the_rules_too() -> None:
    data = {"engine": "embedded", "model": {"name": "m", "context_length": 64},
            "defaults": {"max_total_tokens": 64},
            "prefill": [{"name": "p", "port": 30100, "bootstrap_port": 8998}],
            "decode": [{"name": "d", "port": 30100}]}
    with pytest.raises(TopologyError) as info:
        topology_from_data(data)
    assert [(p.line, p.field) for p in info.value.problems] == [(None, "decode[0].port")]
    data["decode"][0]["port"] = 30200
    assert topology_from_data(data).worker("d").page_size == 64


# --- whole-file problems -----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "line", "message"), [
    ("engine: embedded\nmodel: {name: x\nprefill: []\n", 3, "not valid YAML"),
    ("engine: embedded\n\tmodel: x\n", 2, "not valid YAML"),
    ("", None, "the file is empty"),
    ("# only a comment\n", None, "the file is empty"),
    ("- engine: embedded\n", 1, "holds a list, not a mapping"),
    ("just words\n", 1, "not a mapping"),
    ("a: 1\n---\nb: 2\n", 2, "not valid YAML"),
])
def test_unreadable_file_is_one_problem_with_its_line(text: str, line: int | None, message: str) -> None:
    (problem,) = problems(text)
    assert (problem.line, problem.field) == (line, "") and message in problem.message and problem.fix


def test_missing_file() -> None:
    with pytest.raises(TopologyError, match="file not found — check the path") as info:
        load_topology("no/such/topology.yaml")
    assert info.value.exit_code == 2
    assert "start from see" not in str(info.value) and "to start a new one, see the commented" in str(info.value)


def test_duplicate_key_is_reported() -> None:
    text = edit(BASE, "  port: 30001\n", "  port: 30001\n  port: 30002\n")
    check(text, "router.port", line_of(text, "port: 30002"), "key given twice (first on line 7)", "keep one")


def test_merge_keys_may_be_overridden() -> None:
    text = edit(BASE, "decode:\n  - name: decode-0\n    device: cpu\n",
                "decode:\n  - <<: {name: decode-0, device: cpu, port: 1}\n")
    assert parse_topology(text).worker("decode-0").port == 30200


def test_one_file_reports_every_problem_at_once() -> None:
    path = REPO / "examples" / "invalid" / "many-problems.yaml"
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    text = path.read_text()
    got = [(p.line, p.field) for p in info.value.problems]
    assert got == [
        (line_of(text, "gpus: [0]"), "prefill[0].gpus"),
        (line_of(text, "port: 30001", 2), "prefill[0].port"),
        (line_of(text, "page_sise"), "prefill[0].page_sise"),
        (line_of(text, "device: cuda"), "decode[0].device"),
        (line_of(text, "gpus: [0, 1]"), "decode[0].gpus"),
        (line_of(text, "tp: 4"), "decode[0].tp"),
        (line_of(text, "bootstrap_port: 8998", 2), "decode[0].bootstrap_port"),
        (line_of(text, "bootstrap_port: 8998", 2), "decode[0].bootstrap_port"),
        (line_of(text, "kv_cache_dtype: fp8_e4m3"), "decode[0].kv_cache_dtype"),
        (line_of(text, "kv_cache_dtype: fp8_e4m3"), "decode[0].kv_cache_dtype"),
    ]
    lines = str(info.value).splitlines()
    assert len(lines) == len(got) and all(line.startswith(f"{path}:") and " — " in line for line in lines)
    assert info.value.exit_code == 2


def test_check_command_exits_2_listing_problems(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(REPO / "examples" / "invalid" / "many-problems.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 11 and err[-1].endswith("10 problem(s) in " + str(REPO / "examples" / "invalid" / "many-problems.yaml")
                                              + "; nothing was started")
    assert main([str(REPO / "examples" / "local.yaml")]) == 0
    assert "ok — engine embedded, 1 prefill + 1 decode, router 0.0.0.0:30001" in capsys.readouterr().out


def test_check_command_as_a_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(edit(BASE, "engine: embedded", "engine: vllm"))
    run = subprocess.run([sys.executable, "-m", "dsv4_cluster.orchestrator.topology.load", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{bad}:1: engine: unknown engine 'vllm'" in run.stderr


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(value, dict):
        out += [p for k, v in value.items() for p in _paths(v, path + (k,))]
    elif isinstance(value, list):
        out += [p for i, v in enumerate(value) for p in _paths(v, path + (i,))]
    return out


@pytest.mark.parametrize("text", [BASE, SGLANG], ids=["embedded", "sglang"])
def test_garbage_anywhere_is_a_problem_never_a_crash(text: str) -> None:
    data = yaml.safe_load(text)
    rejected = 0
    for path in _paths(data):
        for garbage in (None, "x", -1, 1.5, True, [], {}, [None], {"k": 1}):
            broken = copy.deepcopy(data)
            parent = broken
            for part in path[:-1]:
                parent = parent[part]
            parent[path[-1]] = garbage
            try:
                topology_from_data(broken)
            except TopologyError as exc:
                rejected += 1
                assert all(p.field and p.message and p.fix for p in exc.problems), str(exc)
    assert rejected > 5 * len(_paths(data))  # most garbage is refused; None is fine for optional keys
