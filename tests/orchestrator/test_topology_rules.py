"""Each cross-field and per-field topology rule: the problem names the field, its line, and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_cluster.orchestrator.topology.load import parse_topology

from tests.topology_fixtures import BASE, SGLANG, check, edit, line_of, only, problems


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


def test_a_worker_may_not_take_the_routers_name() -> None:
    """It said so without file or line (a plan error after the topology had loaded)."""
    text = edit(BASE, "name: decode-0", "name: router")
    check(text, "decode[0].name", line_of(text, "name: router"), "'router' is the router's own process name",
          "rename the worker")


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
    flash = "\n    extra_args: [--model-preset, flash]"   # float32 (auto on the CPU) against fp8 rows
    text = edit(edit(BASE, "  page_size: 16", "  page_size: 256"), "    bootstrap_port: 8998",
                "    bootstrap_port: 8998" + flash)
    text = edit(text, "    port: 30200", "    port: 30200\n    kv_cache_dtype: fp8_e4m3" + flash)
    check(text, "decode[0].kv_cache_dtype", line_of(text, "kv_cache_dtype: fp8_e4m3"), "'fp8_e4m3' of decode-0 "
          "(decode[0]) differs from 'auto' of prefill-0", "use one kv_cache_dtype for every worker")
    # agreement is judged as SGLang runs it: "auto" is fp8_e4m3 there
    parse_topology(edit(SGLANG, "    port: 30200", "    port: 30200\n    kv_cache_dtype: auto"))


def test_sglang_page_size_is_256_whatever_it_is_told() -> None:
    text = SGLANG + "defaults:\n  page_size: 64\n"
    check(text, "defaults.page_size", line_of(text, "page_size: 64"), "256-token pages whatever --page-size says",
          "set page_size: 256, or remove it")
    assert parse_topology(SGLANG).worker("decode-0").page_size == 256
    assert parse_topology(BASE.replace("  page_size: 16\n", "")).worker("decode-0").page_size == 64


@pytest.mark.parametrize("kernels", ["", "kernels: {sparse_mla_decode: false, indexer: false, topk: false}\n"])
def test_sglang_runs_deepseek_v4_with_fp8_kv_only(kernels: str) -> None:
    """bf16 passes SGLang 0.5.23's parser, then its V4 KV pool asserts uint8 (fp8) rows at start, after the weights
    loaded: said at check time, with or without our kernels."""
    text = SGLANG + kernels + "defaults:\n  kv_cache_dtype: bf16\n"
    check(text, "defaults.kv_cache_dtype", line_of(text, "kv_cache_dtype: bf16"),
          "SGLang 0.5.23 keeps DeepSeek-V4's KV in fp8_e4m3 only", "set kv_cache_dtype: auto")


def test_sglang_gpus_must_be_consecutive() -> None:
    text = edit(SGLANG, "gpus: [2, 3]", "gpus: [3, 5]")
    check(text, "decode[0].gpus", line_of(text, "gpus: [3, 5]"), "must be consecutive and ascending", "e.g. [3, 4]")


def test_embedded_engine_options_are_checked_before_start() -> None:
    text = edit(BASE, "kv_cache_dtype: auto", "kv_cache_dtype: fp8_e4m3")
    check(text, "defaults.kv_cache_dtype", line_of(text, "fp8_e4m3"), "the tiny preset", "kv_cache_dtype: auto")
    text = edit(BASE, "    device: cpu\n    port: 30200", '    device: cpu\n    port: 30200\n    extra_args: ["--model-preset", "flash"]')
    check(text, "defaults.page_size", line_of(text, "page_size: 16"), "multiple of the compression ratio 128",
          "page_size: 256")
    text = BASE + "transfer:\n  backend: tcp\n"
    check(text, "transfer.backend", line_of(text, "backend: tcp"), "NIXL only", "use backend: nixl")
    text = edit(BASE, "    device: cpu\n    port: 30200", "    device: cuda\n    gpus: [0]\n    port: 30200")
    text += "kernels: {sparse_mla_decode: true, indexer: true, topk: true}\n"
    check(text, "decode[0].device", line_of(text, "device: cuda"), "its model preset is 'tiny', whose shapes",
          'add extra_args: ["--model-preset", "flash"]')


def test_embedded_workers_on_cuda_may_share_a_gpu_with_the_flash_preset() -> None:
    text = Path(__file__).resolve().parents[2].joinpath("examples", "gpu.yaml").read_text()
    topology = parse_topology(text)
    assert [w.gpus for w in topology.workers] == [[0], [0]]
    check(text.replace('"--model-preset", "flash", "--cuda', '"--cuda'), "decode[0].device",
          line_of(text, "device: cuda", 2), "its model preset is 'tiny'", "--model-preset")


def test_an_embedded_worker_takes_one_gpu() -> None:
    text = Path(__file__).resolve().parents[2].joinpath("examples", "gpu2.yaml").read_text()
    assert [w.gpus for w in parse_topology(text).workers] == [[0], [1]]
    text = text.replace("gpus: [1]", "gpus: [1, 2]")
    check(text, "decode[0].gpus", line_of(text, "gpus: [1, 2]"), "lists 2 GPUs, but an embedded worker is one process",
          "list one GPU")


@pytest.mark.parametrize(("base", "problem"), [(BASE, "NIXL only"), (SGLANG, "SGLang has no tcp KV transfer")],
                         ids=["embedded", "sglang"])
def test_tcp_transfer_fix_names_no_engine_that_has_it(base: str, problem: str) -> None:
    """Neither engine moves KV over tcp: the fix must not send the operator to the other engine for it."""
    text = base + "transfer:\n  backend: tcp\n"
    p = check(text, "transfer.backend", line_of(text, "backend: tcp"), problem, "use backend: nixl")
    assert "neither engine has a tcp" in p.fix and "exists for" not in p.fix


def test_no_prefill_or_empty_decode() -> None:
    text = BASE.split("prefill:")[0] + "decode: []\n"
    found = problems(text)
    assert only(found, "prefill").message == "required key 'prefill' is missing" and only(found, "prefill").line == 1
    p = only(found, "decode")
    assert (p.line, p.message, "add a worker" in p.fix) == (line_of(text, "decode: []"), "decode needs at least one worker, got none", True)


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
    text = SGLANG + "transfer:\n  backend: tcp\n"
    check(text, "transfer.backend", line_of(text, "backend: tcp"), "SGLang has no tcp KV transfer", "use backend: nixl")
    text = edit(SGLANG, "    device: cuda\n    gpus: [2, 3]\n    tp: 2\n", "")
    check(text, "decode[0].device", line_of(text, "- name: decode-0"), "serves on CUDA only", "use engine: embedded")


def test_embedded_needs_max_total_tokens() -> None:
    text = edit(BASE, "  max_total_tokens: 16384\n", "")
    check(text, "defaults.max_total_tokens", line_of(text, "defaults:"), "needs a KV pool size; prefill-0 (prefill[0]), "
          "decode-0 (decode[0]) have none", "set defaults.max_total_tokens (e.g. 16384)")


def test_kv_pool_must_hold_one_full_request() -> None:
    text = edit(BASE, "max_total_tokens: 16384", "max_total_tokens: 1024")
    check(text, "defaults.max_total_tokens", line_of(text, "1024"), "below model.context_length 2048", "at least 2048")
    # the pool is whole pages (the worker refuses the rest at start): 2055 tokens in 16-token pages hold 2048
    parse_topology(edit(BASE, "max_total_tokens: 16384", "max_total_tokens: 2050"))
    text = edit(edit(BASE, "max_total_tokens: 16384", "max_total_tokens: 2055"), "context_length: 2048",
                "context_length: 2050")
    check(text, "defaults.max_total_tokens", line_of(text, "2055"), "its whole pages of 16 tokens hold 2048, below "
          "model.context_length 2050", "at least 2064")
    text = edit(edit(BASE, "max_total_tokens: 16384", "max_total_tokens: 1024"), "context_length: 2048",
                "context_length: 2050")   # below the context outright: the advice is a whole page too
    check(text, "defaults.max_total_tokens", line_of(text, "1024"), "1024 is below model.context_length 2050",
          "at least 2064")


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
    assert parse_topology(SGLANG + "defaults:\n  page_size: 256\n").worker("decode-0").page_size == 256


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
    ("engine: embedded\n", "engine: embedded\nkernels:\n", "kernels", "expected a mapping, got None", "remove the key to get the defaults"),
    ("engine: embedded\n", "engine: embedded\nnodes: []\n", "nodes", "needs at least one node", "remove 'nodes' to get that default"),
    ("    device: cpu\n    port: 30200", "    device: cuda\n    gpus: [-1]\n    port: 30200", "decode[0].gpus[0]", "-1 is out of range", ">= 0"),
])
def test_field_errors_name_field_and_fix(old: str, new: str, field: str, message: str, fix: str) -> None:
    text = edit(BASE, old, new)
    changed = [line for line in new.splitlines() if line not in old.splitlines()][-1]
    check(text, field, line_of(text, changed), message, fix)
