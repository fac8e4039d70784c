"""Topology loading: the shipped layouts load resolved, and every rule reports field, line and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_cluster.orchestrator.topology import (
    Problem,
    TopologyError,
    UnknownNameError,
    load_topology,
    parse_topology,
    topology_from_data,
)

REPO = Path(__file__).resolve().parents[1]

BASE = """\
engine: embedded
model:
  name: dsv4-tiny
  context_length: 2048
router:
  host: 0.0.0.0
  port: 30001
defaults:
  page_size: 16
  kv_cache_dtype: auto
  max_total_tokens: 16384
prefill:
  - name: prefill-0
    device: cpu
    port: 30100
    bootstrap_port: 8998
decode:
  - name: decode-0
    device: cpu
    port: 30200
"""

SGLANG = """\
engine: sglang
model:
  name: DeepSeek-V4-Flash
  path: deepseek-ai/DeepSeek-V4-Flash
  context_length: 131072
prefill:
  - name: prefill-0
    device: cuda
    gpus: [0, 1]
    tp: 2
    port: 30100
    nccl_port: 30110
    bootstrap_port: 8998
decode:
  - name: decode-0
    device: cuda
    gpus: [2, 3]
    tp: 2
    port: 30200
    nccl_port: 30210
"""


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"fixture edit {old!r} must match exactly once"
    return text.replace(old, new)


def problems(text: str) -> list[Problem]:
    with pytest.raises(TopologyError) as info:
        parse_topology(text, source="t.yaml")
    return info.value.problems


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits[occurrence - 1]


def only(found: list[Problem], field: str) -> Problem:
    matching = [p for p in found if p.field == field]
    assert len(matching) == 1, f"expected one problem at {field}, got {[str(p) for p in found]}"
    return matching[0]


def check(text: str, field: str, line: int | None, message: str, fix: str) -> Problem:
    problem = only(problems(text), field)
    assert problem.line == line, str(problem)
    assert message in problem.message, str(problem)
    assert fix in problem.fix, str(problem)
    assert str(problem).startswith(f"t.yaml:{line}: {field}: ") if line else True
    return problem


# --- the shipped layouts ---------------------------------------------------------------------

def test_production_topology_loads_resolved() -> None:
    topo = load_topology(REPO / "topology.yaml")
    assert (topo.engine, topo.model.path, topo.model.context_length) == ("sglang", "deepseek-ai/DeepSeek-V4-Flash", 131072)
    prefill, decode = topo.worker("prefill-0"), topo.worker("decode-0")
    assert (prefill.role, prefill.device, prefill.gpus, prefill.tp, prefill.numa_node) == ("prefill", "cuda", [0, 1, 2, 3], 4, 0)
    assert (prefill.port, prefill.nccl_port, prefill.bootstrap_port) == (30100, 30110, 8998)
    assert (decode.role, decode.gpus, decode.tp, decode.numa_node) == ("decode", [4, 5, 6, 7], 4, 1)
    assert (decode.port, decode.nccl_port, decode.bootstrap_port) == (30200, 30210, None)
    assert all((w.page_size, w.kv_cache_dtype, w.node) == (64, "fp8_e4m3", "local") for w in topo.workers)
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


def test_duplicate_key_is_reported() -> None:
    text = edit(BASE, "  port: 30001\n", "  port: 30001\n  port: 30002\n")
    check(text, "router.port", line_of(text, "port: 30002"), "key given twice (first on line 7)", "keep one")


# --- one test per rule -------------------------------------------------------------------------

@pytest.mark.parametrize(("old", "new", "field", "hint"), [
    ("engine: embedded\n", "engine: embedded\ncolour: red\n", "colour", "remove it; allowed here: cluster, decode"),
    ("  name: dsv4-tiny\n", "  name: dsv4-tiny\n  seeds: 3\n", "model.seeds", "did you mean 'seed'?"),
    ("    device: cpu\n    port: 30200\n", "    device: cpu\n    port: 30200\n    gpu: 0\n", "decode[0].gpu", "did you mean 'gpus'?"),
])
def test_unknown_key_anywhere(old: str, new: str, field: str, hint: str) -> None:
    text = edit(BASE, old, new)
    key = field.rsplit(".", 1)[-1]
    check(text, field, line_of(text, f"{key}:"), f"unknown key '{key}'", hint)


def test_unknown_engine_lists_the_choices() -> None:
    text = edit(BASE, "engine: embedded", "engine: vllm")
    check(text, "engine", 1, "unknown engine 'vllm'", "use one of: 'embedded' or 'sglang'")


def test_gpu_used_twice_names_both_workers() -> None:
    text = edit(SGLANG, "gpus: [2, 3]", "gpus: [1, 2]")
    p = check(text, "decode[0].gpus[0]", line_of(text, "gpus: [1, 2]"), "GPU 1 on node 'local' is given to both",
              "give each GPU to one worker only")
    assert "prefill-0" in p.message and "decode-0" in p.message


def test_gpu_listed_twice_in_one_worker() -> None:
    text = edit(SGLANG, "gpus: [2, 3]", "gpus: [2, 2]")
    check(text, "decode[0].gpus[1]", line_of(text, "gpus: [2, 2]"), "GPU 2 is listed twice", "list each GPU once")


def test_cuda_tp_must_match_gpu_count() -> None:
    text = edit(SGLANG, "gpus: [2, 3]\n    tp: 2", "gpus: [2, 3]\n    tp: 4")
    check(text, "decode[0].tp", line_of(text, "tp: 4"), "tp is 4 but 2 GPU(s)", "set tp: 2, or list exactly 4 GPUs")
    text = edit(SGLANG, "    gpus: [2, 3]\n    tp: 2\n", "")
    check(text, "decode[0].gpus", line_of(text, "- name: decode-0"), "device cuda needs GPUs", "gpus: [0, 1, 2, 3]")


def test_cpu_takes_no_gpus_and_tp_one() -> None:
    text = edit(BASE, "    device: cpu\n    port: 30200", "    device: cpu\n    gpus: [0]\n    tp: 2\n    port: 30200")
    found = problems(text)
    for field, needle, message, fix in [("decode[0].gpus", "gpus: [0]", "device cpu takes no GPUs", "remove 'gpus'"),
                                        ("decode[0].tp", "tp: 2", "device cpu runs tp: 1 only", "set tp: 1")]:
        p = only(found, field)
        assert (p.line, message in p.message, fix in p.fix) == (line_of(text, needle), True, True), str(p)


def test_worker_port_equal_to_router_port() -> None:
    text = edit(BASE, "port: 30200", "port: 30001")
    check(text, "decode[0].port", line_of(text, "port: 30001", 2), "port 30001 on node 'local' is also router.port",
          "the router owns its port")


def test_ports_collide_across_workers_and_kinds() -> None:
    text = edit(SGLANG, "nccl_port: 30210", "nccl_port: 30110")
    check(text, "decode[0].nccl_port", line_of(text, "nccl_port: 30110", 2),
          "port 30110 on node 'local' is also prefill[0].nccl_port of prefill-0", "different, free value")
    text = edit(BASE, "bootstrap_port: 8998", "bootstrap_port: 30100")
    check(text, "prefill[0].bootstrap_port", line_of(text, "bootstrap_port"), "is also prefill[0].port", "free value")


def test_ports_are_per_host() -> None:
    nodes = "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n"
    text = nodes + edit(BASE, "    port: 30200", "    node: b\n    port: 30100")
    assert parse_topology(text).worker("decode-0").node == "b"  # same port, other host: fine
    text = text.replace("10.0.0.2", "10.0.0.1")  # two node names, one host
    check(text, "decode[0].port", line_of(text, "port: 30100", 2), "port 30100 on node 'b' is also prefill[0].port", "free")


def test_duplicate_worker_names() -> None:
    text = edit(BASE, "name: decode-0", "name: prefill-0")
    check(text, "decode[0].name", line_of(text, "name: prefill-0", 2), "'prefill-0' is also used by prefill[0]", "unique")


def test_worker_or_router_on_unknown_node() -> None:
    text = edit(BASE, "    port: 30200", "    node: gpu-host\n    port: 30200")
    check(text, "decode[0].node", line_of(text, "node: gpu-host"), "unknown node 'gpu-host'", "'nodes:' (local)")
    text = edit(BASE, "  port: 30001\n", "  port: 30001\n  node: edge\n")
    check(text, "router.node", line_of(text, "node: edge"), "unknown node 'edge'", "add a node named 'edge'")


def test_prefill_and_decode_disagree_on_page_size() -> None:
    text = edit(BASE, "    bootstrap_port: 8998", "    bootstrap_port: 8998\n    page_size: 32")
    p = check(text, "defaults.page_size", line_of(text, "page_size: 16"), "page_size 16 of decode-0 (decode[0]) differs "
              "from 32 of prefill-0 (prefill[0]) (prefill[0].page_size)", "use one page_size for every worker")
    assert "set defaults.page_size" in p.fix


def test_prefill_and_decode_disagree_on_kv_dtype() -> None:
    text = edit(BASE, "    port: 30200", "    port: 30200\n    kv_cache_dtype: fp8_e4m3")
    check(text, "decode[0].kv_cache_dtype", line_of(text, "kv_cache_dtype: fp8"), "'fp8_e4m3' of decode-0 (decode[0]) "
          "differs from 'auto' of prefill-0", "use one kv_cache_dtype for every worker")


def test_no_prefill_or_empty_decode() -> None:
    text = BASE.split("prefill:")[0] + "decode: []\n"
    found = problems(text)
    assert only(found, "prefill").message == "required key 'prefill' is missing" and only(found, "prefill").line == 1
    p = only(found, "decode")
    assert (p.line, p.message, "add a worker" in p.fix) == (line_of(text, "decode: []"), "decode needs at least 1 worker, got none", True)


def test_bootstrap_port_missing_on_prefill_present_on_decode() -> None:
    text = edit(BASE, "    bootstrap_port: 8998\n", "")
    check(text, "prefill[0].bootstrap_port", line_of(text, "- name: prefill-0"), "has no bootstrap_port", "e.g. 8998")
    text = edit(BASE, "    port: 30200", "    port: 30200\n    bootstrap_port: 8999")
    check(text, "decode[0].bootstrap_port", line_of(text, "8999"), "decode workers run no bootstrap server", "remove")


def test_sglang_needs_model_path_nccl_ports_and_cuda() -> None:
    text = edit(SGLANG, "  path: deepseek-ai/DeepSeek-V4-Flash\n", "")
    check(text, "model.path", 2, "engine sglang needs the weights", "set model.path")
    text = edit(SGLANG, "    nccl_port: 30210\n", "")
    check(text, "decode[0].nccl_port", line_of(text, "- name: decode-0"), "needs an nccl_port for decode-0", "add nccl_port")
    text = edit(SGLANG, "    device: cuda\n    gpus: [2, 3]\n    tp: 2\n", "")
    check(text, "decode[0].device", line_of(text, "- name: decode-0"), "serves on CUDA only", "use engine: embedded")


def test_embedded_needs_max_total_tokens() -> None:
    text = edit(BASE, "  max_total_tokens: 16384\n", "")
    check(text, "defaults.max_total_tokens", line_of(text, "defaults:"), "needs a KV pool size; prefill-0 (prefill[0]), "
          "decode-0 (decode[0]) have none", "set defaults.max_total_tokens (e.g. 16384)")


def test_kv_pool_must_hold_one_full_request() -> None:
    text = edit(BASE, "max_total_tokens: 16384", "max_total_tokens: 1024")
    check(text, "defaults.max_total_tokens", line_of(text, "1024"), "below model.context_length 2048", "at least 2048")


@pytest.mark.parametrize(("value", "message"), [("0", "port 0 is out of range"), ("70000", "port 70000 is out of range")])
def test_ports_must_be_in_range(value: str, message: str) -> None:
    text = edit(BASE, "port: 30200", f"port: {value}")
    check(text, "decode[0].port", line_of(text, f"port: {value}"), message, "1..65535")


def test_ports_are_not_coerced_from_strings() -> None:
    text = edit(BASE, "port: 30200", 'port: "30200"')
    check(text, "decode[0].port", line_of(text, '"30200"'), "expected a whole number, got '30200'", "without quotes")


def test_page_size_positive_and_embedded_multiple_of_four() -> None:
    text = edit(BASE, "page_size: 16", "page_size: 0")
    check(text, "defaults.page_size", line_of(text, "page_size: 0"), "0 is out of range", ">= 1")
    text = edit(BASE, "page_size: 16", "page_size: 18")
    check(text, "defaults.page_size", line_of(text, "page_size: 18"), "not a multiple of 4", "e.g. 16 or 64")
    assert parse_topology(SGLANG + "defaults:\n  page_size: 18\n").worker("decode-0").page_size == 18


def test_role_key_must_match_its_list() -> None:
    text = edit(BASE, "    port: 30200", "    port: 30200\n    role: prefill")
    check(text, "decode[0].role", line_of(text, "role: prefill"), "listed under decode says role: 'prefill'", "remove 'role'")


@pytest.mark.parametrize(("old", "new", "field", "message", "fix"), [
    ("name: decode-0", "name: Decode_0", "decode[0].name", "'Decode_0' is not a valid name", "lowercase letters"),
    ("engine: embedded\n", "engine: embedded\ncluster:\n  address: auto\n", "cluster.address", "not a host:port", '"host:port"'),
    ("    device: cpu\n    port: 30200", "    device: gpu\n    port: 30200", "decode[0].device", "unknown device 'gpu'", "'cpu' or 'cuda'"),
    ("engine: embedded\n", "engine: embedded\nkernels:\n  topk: yes please\n", "kernels.topk", "expected true or false", "true or false"),
    ("  name: dsv4-tiny\n", "  name: dsv4-tiny\n  seed: -1\n", "model.seed", "-1 is out of range", ">= 0"),
    ("engine: embedded\n", "engine: embedded\ntransfer: nixl\n", "transfer", "expected a mapping, got 'nixl'", "indented under it"),
])
def test_field_errors_name_field_and_fix(old: str, new: str, field: str, message: str, fix: str) -> None:
    text = edit(BASE, old, new)
    changed = [line for line in new.splitlines() if line not in old.splitlines()][-1]
    check(text, field, line_of(text, changed), message, fix)


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
        (line_of(text, "tp: 4"), "decode[0].tp"),
        (line_of(text, "bootstrap_port: 8998", 2), "decode[0].bootstrap_port"),
        (line_of(text, "bootstrap_port: 8998", 2), "decode[0].bootstrap_port"),
        (line_of(text, "kv_cache_dtype: bf16"), "decode[0].kv_cache_dtype"),
    ]
    lines = str(info.value).splitlines()
    assert len(lines) == len(got) and all(line.startswith(f"{path}:") and " — " in line for line in lines)
    assert info.value.exit_code == 2
