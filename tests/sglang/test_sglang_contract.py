"""Contract with SGLang 0.5.23, against its own code (installed in CI by .ci/install, never skipped there).

- every generated argv goes through SGLang's parser and its model-aware resolution against the
  committed DeepSeek-V4-Flash config.json (tests/data/deepseek-v4-flash, public values);
- our plugin is discovered and run by SGLang's real `load_plugins()` in a process of its own (forked from one that
  only imported SGLang: tests/sglang_zygote.py);
- every call site the adapters replace exists with the signature they were written for, and
  SGLang builds the attention backends before it captures CUDA graphs.
"""

from __future__ import annotations

import ast
import inspect
import json
from typing import Any, Iterator

import pytest

from dsv4_cluster.kernels import sglang_adapters
from dsv4_cluster.kernels.sglang_plugin.call_sites import CALL_SITES, check_call_site, module_source
from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, SGLANG_VERSION
from dsv4_cluster.orchestrator.launch.plan import cluster_plans
from dsv4_cluster.orchestrator.topology.load import load_topology
from tests.sglang_support import REPO, child_result, require_sglang, start_child
from tests.sglang_support import server_argv as _server_argv

require_sglang()
WORKERS, _ = cluster_plans(load_topology(REPO / "topology.yaml"))


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every SGLang child of this module, started together (each a process of its own: SGLang's plugins
    load once per process); each test reads its own with `child_result`. `*_dir`: the folders they were given."""
    page_64 = _server_argv(WORKERS[1])
    page_64[page_64.index("--page-size") + 1] = "64"
    attest_dir, install_dir = tmp_path_factory.mktemp("attest"), tmp_path_factory.mktemp("install")
    procs = {
        "resolve": start_child("resolve", json.dumps([*(_server_argv(p) for p in WORKERS), page_64])),
        "inert": start_child("plugin", env={KERNELS_ENV: "", ATTEST_DIR_ENV: ""}),
        "wraps": start_child("plugin", env={KERNELS_ENV: "sparse_mla_decode,topk", ATTEST_DIR_ENV: str(attest_dir)}),
        "misconfigured": start_child("plugin", env={KERNELS_ENV: "sparse_mla_decode,flashy",
                                                    ATTEST_DIR_ENV: "/nonexistent"}),
        "install": start_child("install", str(install_dir)),
    }
    try:
        yield {**procs, "install_dir": install_dir}
    finally:
        for c in procs.values():
            c.kill()


@pytest.fixture(scope="module")
def resolved(children: dict[str, Any]) -> dict[str, dict]:
    """Both planned servers, and the decode argv with --page-size 64, resolved by one SGLang child."""
    workers = WORKERS
    results = child_result(children["resolve"])
    out = {plan.name: {"plan": plan, **r} for plan, r in zip(workers, results)}
    out["page-64"] = results[-1]
    return out


def test_sglang_resolves_both_servers_as_planned(resolved: dict[str, dict]) -> None:
    for name in ("prefill-0", "decode-0"):
        plan, r = resolved[name]["plan"], resolved[name]["resolved"]
        assert r["page_size"] == 256, name  # what we emit is what DeepSeek-V4 runs with
        assert r["kv_cache_dtype"] == "fp8_e4m3" and r["attention_backend"] == "dsv4"
        assert r["context_length"] == 131072 and r["tp_size"] == 4
        assert r["disaggregation_mode"] == plan.role.value and r["disaggregation_transfer_backend"] == "nixl"
        first_gpu = 0 if plan.role.value == "prefill" else 4
        assert (r["base_gpu_id"], r["gpu_id_step"]) == (first_gpu, 1)
        numa = 0 if plan.role.value == "prefill" else 1
        assert r["numa_node"][first_gpu:first_gpu + 4] == [numa] * 4  # SGLang reads numa_node[gpu_id]
        assert (r["reasoning_parser"], r["tool_call_parser"]) == ("deepseek-v4", "deepseekv4")
        assert r["enable_metrics"] is True and r["served_model_name"] == "DeepSeek-V4-Flash"
        assert r["enable_cache_report"] is True   # else SGLang's usage carries no prompt_tokens_details
    assert resolved["prefill-0"]["resolved"]["disaggregation_bootstrap_port"] == 8998


def test_sglang_would_override_any_other_page_size(resolved: dict[str, dict]) -> None:
    """The fact the page-size rule rests on: SGLang replaces 64 with 256 for DeepSeek-V4."""
    got = resolved["page-64"]
    assert (got["parsed"]["page_size"], got["resolved"]["page_size"]) == (64, 256)


def test_plugin_is_inert_without_kernels_env(children: dict[str, Any]) -> None:
    got = child_result(children["inert"])  # KERNELS_ENV and ATTEST_DIR_ENV empty
    assert got["replaced"] is False and got["name"] == got["stock_name"] == "create_dsv4_backend"


def test_real_load_plugins_discovers_and_wraps_the_dsv4_factory(children: dict[str, Any]) -> None:
    got = child_result(children["wraps"])  # KERNELS_ENV sparse_mla_decode,topk
    assert got["replaced"] and got["wraps_stock"]
    assert got["name"] == "create_dsv4_backend_with_dsv4_cluster_kernels"


def test_misconfigured_plugin_env_fails_closed_from_the_factory(children: dict[str, Any]) -> None:
    got = child_result(children["misconfigured"])  # KERNELS_ENV sparse_mla_decode,flashy; no attest dir
    assert got["replaced"] and got["name"] == "refuse"  # the factory raises; register() itself never does


def test_factory_installs_on_sglangs_backend_class_and_fails_closed(children: dict[str, Any]) -> None:
    got, tmp_path = child_result(children["install"]), children["install_dir"]
    ok = got["ok"]
    assert ok["flash_mla_keywords"] == {"use_legacy": True}  # SGLang's own binding kept
    assert ok["flash_mla_adapter"] == "dsv4_cluster.kernels.sglang_adapters.flash_mla"
    assert ok["topk_adapters"] == ["dsv4_cluster.kernels.sglang_adapters.topk"] * 2
    att = ok["attestation"]
    assert (att["worker"], att["rank"], att["gpu"], att["sglang_version"]) == ("decode-0", 1, 5, SGLANG_VERSION)
    topk_sites = ["sglang.kernels.ops.attention.dsv4.topk.topk_transform_paged_v2",
                  "sglang.srt.layers.attention.dsv4.indexer.topk_transform_paged_v2"]
    metadata_sites = ["sglang.kernels.ops.attention.dsv4.metadata_kernel._init_compressed_attn_metadata_triton",
                      "sglang.kernels.ops.attention.dsv4.attn_metadata_kernels.build_page_table_positions_triton"]
    decode_sites = ["DeepseekV4AttnBackend._flash_mla_with_kvcache", *metadata_sites]
    assert att["call_sites"] == {"sparse_mla_decode": decode_sites, "topk": topk_sites}
    assert (att["gpu_class"], att["kernels"]) == ("sm_90", {"sparse_mla_decode": "ours", "indexer": "stock", "topk": "ours"})
    # the route table leaves a B = 1 window-only call on sm_90 to SGLang's own partial, with its keywords
    assert ok["stock_call"] == ["stock FlashMLA", ["k_cache", "q", "use_legacy"]]
    assert ok["hooked"] is True  # every DeepseekV4AttnBackend from now on (draft step backends too) is routed
    assert att["decode_routes"]["c4 / 64 heads"].startswith("ours at B = 64; stock elsewhere")
    assert ok["counters"]["counts"] == {"sparse_mla_decode": 0, "indexer": 0, "topk": 0,
                                        "sparse_mla_decode_stock": 0, "sparse_mla_decode_metadata": 0}
    assert ok["metadata_adapters"] == ["dsv4_cluster.kernels.sglang_adapters.metadata"] * 2
    # lengths 300 and 5 over pages 3: 2 and 0 live ratio-128 slots (page 3: slots 6, 7), the rest -1
    assert ok["metadata_call"] == [[6, 7, -1, -1, -1, -1, -1, -1], [-1] * 8]
    assert ok["counters_later"]["counts"]["sparse_mla_decode_metadata"] == 1
    # no DeepGEMM on this machine: asking for the indexer must fail model init, naming it
    assert "indexer: cannot import deep_gemm" in got["indexer"]["error"]
    assert "sparse_mla_decode: the dsv4 factory built a SimpleNamespace" in got["not_dsv4"]["error"]
    assert "DeepSeek-V4.1 checkpoint keeps 528 / 288-byte KV rows" in got["v41"]["error"]
    assert not (tmp_path / "indexer" / "rank1.json").exists()  # nothing attested when install failed
    # sm_120: SGLang's sm_120 entry holds our adapter; the FlashMLA partial (never called there) stays SGLang's
    sm120 = got["sm120"]
    assert sm120["sm120_adapter"] == "dsv4_cluster.kernels.sglang_adapters.flash_mla_sm120"
    assert sm120["flash_mla_adapter"] != "dsv4_cluster.kernels.sglang_adapters.flash_mla"
    assert sm120["attestation"]["gpu_class"] == "sm_120"
    assert sm120["attestation"]["call_sites"] == {
        "sparse_mla_decode": ["sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"],
        "topk": topk_sites}
    assert "no CUDA GPU visible" in got["no_class"]["error"]  # no GPU, no class forced: refused


@pytest.mark.parametrize("site", CALL_SITES, ids=lambda s: f"{s.kernel}:{s.module}")
def test_every_replaced_call_site_exists_with_its_signature(site) -> None:
    check_call_site(site)


def test_adapters_take_exactly_sglangs_parameters() -> None:
    from dsv4_cluster.kernels.sglang_plugin.install import adapter_for

    for site in CALL_SITES:
        if site.params is None:
            continue
        params = inspect.signature(adapter_for(site)).parameters.values()
        if site.kernel == "indexer":  # SGLang calls `fn(...)` with 8 positional arguments: the count is the contract
            _, tree = module_source(site.branch.module)
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "fn"]
            assert calls and all(len(c.args) == len(site.params) and not c.keywords for c in calls)
            assert len([p for p in params if p.default is p.empty]) <= len(site.params) <= len(params)
            continue
        ours = tuple(("*" if p.kind is p.KEYWORD_ONLY else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
                     for p in params)
        assert ours[:len(site.params)] == site.params, site
        assert all(p.default is not p.empty for p in list(params)[len(site.params):])  # extras are optional


def test_backends_are_built_before_cuda_graph_capture() -> None:
    """The plugin installs from the backend factory; SGLang must call it before capturing graphs."""
    _, tree = module_source("sglang.srt.managers.scheduler")
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "init_model_worker")
    calls = [n.func.attr for n in ast.walk(method) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "init_all_attention_backends" in calls and "init_all_cuda_graphs" in calls
    assert calls.index("init_all_attention_backends") < calls.index("init_all_cuda_graphs")
    _, setup = module_source("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
    assert any(isinstance(n, ast.Subscript) and getattr(n.value, "id", None) == "ATTENTION_BACKENDS"
               for n in ast.walk(setup))  # the factory is looked up in the registry the plugin wraps
