"""Launch plans: the argv, env and probes generated for both engines and the router."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_cluster.core import Role
from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, WORKER_ENV
from dsv4_cluster.orchestrator.launch.plan import (
    ROUTE_PROBE, cluster_plans, endpoint, router_settings)
from dsv4_cluster.orchestrator.topology.load import load_topology, parse_topology, topology_from_data
from dsv4_cluster.orchestrator.supervise.router_admin import with_admin_token
from dsv4_cluster.router.settings import OperatorSettings, SettingsError, load_settings
from dsv4_cluster.router.settings_fields import leaves, value_at

REPO = Path(__file__).resolve().parents[2]

# Every flag the sglang plan emits, as SGLang 0.5.23 declares it (read from the 0.5.23 wheel:
# sglang/srt/arg_groups/fields/*.py derive "--" + field name with "_" -> "-"; the two parser
# flags are registered in sglang/srt/server_args.py add_cli_args).
SGLANG_0_5_23_FLAGS = {
    "--model-path", "--served-model-name", "--tp-size", "--host", "--port", "--nccl-port",
    "--disaggregation-mode", "--disaggregation-transfer-backend", "--disaggregation-bootstrap-port",
    "--page-size", "--kv-cache-dtype", "--context-length", "--random-seed", "--max-total-tokens",
    "--enable-metrics", "--enable-cache-report", "--trust-remote-code", "--reasoning-parser", "--tool-call-parser",
    "--base-gpu-id", "--gpu-id-step", "--numa-node",
}


def _local(**overrides: object) -> object:
    return topology_from_data(_local_data(**overrides), source=REPO / "examples" / "x.yaml")


def _local_data(**overrides: object) -> dict[str, Any]:
    return {
        "engine": "embedded", "model": {"name": "dsv4-tiny", "seed": 3, "context_length": 2048},
        "kernels": {"sparse_mla_decode": True, "indexer": False, "topk": True},
        "defaults": {"page_size": 16, "kv_cache_dtype": "auto", "max_total_tokens": 16384},
        "router": {"host": "0.0.0.0", "port": 21001},
        "transfer": {"backend": "nixl", "ucx_tls": "tcp,self"},
        "prefill": [{"name": "prefill-0", "port": 21100, "bootstrap_port": 21098}],
        "decode": [{"name": "decode-0", "port": 21200, "page_size": 16}],
        **overrides,
    }


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def _flags(argv: tuple[str, ...], name: str) -> list[str]:
    """The values of a multi-value flag: everything up to the next flag."""
    rest = argv[argv.index(name) + 1:]
    return list(next((rest[:i] for i, a in enumerate(rest) if a.startswith("--")), rest))


def test_embedded_prefill_and_decode_argv() -> None:
    workers, _ = cluster_plans(_local())
    prefill, decode = workers
    assert prefill.argv[:3] == (sys.executable, "-m", "dsv4_cluster.workers.prefill")
    assert decode.argv[:3] == (sys.executable, "-m", "dsv4_cluster.workers.decode")
    for plan in workers:
        a = plan.argv
        assert (_flag(a, "--served-model-name"), _flag(a, "--seed"), _flag(a, "--context-length")) == \
            ("dsv4-tiny", "3", "2048")
        assert (_flag(a, "--page-size"), _flag(a, "--kv-cache-dtype"), _flag(a, "--max-total-tokens")) == \
            ("16", "auto", "16384")
        assert (_flag(a, "--transfer-backend"), _flag(a, "--device"), _flag(a, "--node-address")) == \
            ("nixl", "cpu", "127.0.0.1")
        assert _flag(a, "--ucx-tls") == "tcp,self" and plan.env_dict["UCX_TLS"] == "tcp,self"
        assert _flag(a, "--kernels") == "sparse_mla_decode,topk"
        assert _flag(a, "--host") == "127.0.0.1"   # the node's address, never 0.0.0.0
    assert _flag(prefill.argv, "--disaggregation-bootstrap-port") == "21098"
    assert "--disaggregation-bootstrap-port" not in decode.argv


def test_readiness_probes_and_log_paths() -> None:
    topo = _local()
    (prefill, decode), router = cluster_plans(topo)
    assert prefill.all_readiness_urls == (
        "http://127.0.0.1:21100/health", "http://127.0.0.1:21098/health",
        f"http://127.0.0.1:21098{ROUTE_PROBE}")
    assert decode.all_readiness_urls == ("http://127.0.0.1:21200/health",)
    assert prefill.ports == (21100, 21098) and router.ports == (21001,)
    assert router.health_url == "http://127.0.0.1:21001/health"  # 0.0.0.0 is probed via the node
    assert decode.log_path == str(topo.run_dir_path / "logs" / "decode-0.log")
    assert (prefill.role, decode.role, router.role) == (Role.PREFILL, Role.DECODE, Role.ROUTER)
    assert endpoint(topo) == "http://localhost:21001/v1"  # a bind-all router: the URL a client here can use
    assert endpoint(topo.model_copy(update={"router": topo.router.model_copy(update={"host": "::1"})})) == \
        "http://[::1]:21001/v1"


def test_no_kernels_no_kernel_flag() -> None:
    topo = _local(kernels={"sparse_mla_decode": False, "indexer": False, "topk": False})
    workers, _ = cluster_plans(topo)
    assert all("--kernels" not in p.argv for p in workers)


def test_router_config_is_accepted_by_the_router(tmp_path: Path) -> None:
    topo = _local(cluster={"run_dir": str(tmp_path)})
    _, router = cluster_plans(topo)
    ((path, text),) = router.files
    Path(path).write_text(text)
    settings = load_settings(path)
    assert (settings.port, settings.model_name, settings.context_length) == (21001, "dsv4-tiny", 2048)
    assert [(p.name, p.url, p.bootstrap_host, p.bootstrap_port) for p in settings.prefill] == \
        [("prefill-0", "http://127.0.0.1:21100", "127.0.0.1", 21098)]
    assert [(d.name, d.url) for d in settings.decode] == [("decode-0", "http://127.0.0.1:21200")]
    assert path == str(tmp_path / "router.json")
    assert router.argv == (sys.executable, "-m", "dsv4_cluster.router", "--config", path)
    assert router_settings(topo).host == "0.0.0.0"


def test_the_topology_router_section_reaches_the_router_typed_and_keys_come_from_their_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys.txt").write_text("# the operators' keys\nkey-one\n\nkey-two  # ci\n")
    router = {"host": "127.0.0.1", "port": 21001, "policy": {"decode": "least_load"},
              "api_keys": {"file": "keys.txt"}, "max_body_bytes": 4096, "request_timeout_s": 30.5}
    topo = topology_from_data(_local(router=router).model_dump(mode="json", exclude={"nodes"}) | {
        "cluster": {"run_dir": str(tmp_path)}}, source=tmp_path / "topology.yaml")
    _, plan = cluster_plans(topo)
    settings = plan.router_settings
    assert (settings.policy.prefill, settings.policy.decode) == ("round_robin", "least_load")
    assert (settings.max_body_bytes, settings.request_timeout_s) == (4096, 30.5)
    assert settings.api_keys == [] and settings.api_keys_file == str(tmp_path / "keys.txt")
    ((path, text),) = with_admin_token(plan, "t" * 20).files
    Path(path).write_text(text)
    loaded = load_settings(path)  # what the router reads: the same settings, the keys read from their file
    assert loaded.api_keys == ["key-one", "key-two"] and loaded.admin_token == "t" * 20
    assert loaded.model_copy(update={"api_keys": [], "admin_token": None}) == settings

    router["api_keys"] = {"env": "DSV4_TEST_KEYS"}
    topo = topology_from_data(topo.model_dump(mode="json", exclude={"nodes"}) | {"router": router},
                              source=tmp_path / "topology.yaml")
    _, plan = cluster_plans(topo)
    ((path, text),) = plan.files
    assert "DSV4_TEST_KEYS" in text
    Path(path).write_text(text)
    monkeypatch.delenv("DSV4_TEST_KEYS", raising=False)
    with pytest.raises(SettingsError, match="DSV4_TEST_KEYS .* not set"):
        load_settings(path)
    monkeypatch.setenv("DSV4_TEST_KEYS", "a-key, another")
    assert load_settings(path).api_keys == ["a-key", "another"]


# values no generic rule picks: text, a policy name, a list
_CHOSEN = {"host": "127.0.0.1", "policy.prefill": "prefix", "policy.decode": "least_load", "model_aliases": ["tiny"]}


def test_every_router_setting_written_in_the_topology_reaches_the_routers_settings_file(tmp_path: Path) -> None:
    """Each operator setting of the router's model, set to a value of its own in topology YAML, is what the router
    reads back from the settings file `plan` renders."""
    expected, router = {}, {}
    for key, info in leaves(OperatorSettings):
        default = info.get_default(call_default_factory=True)
        expected[key] = _CHOSEN[key] if key in _CHOSEN else type(default)(default / 2)  # within every limit
        assert expected[key] != default, f"{key}: give the test a value other than its default"
        *parents, last = key.split(".")
        section = router
        for part in parents:
            section = section.setdefault(part, {})
        section[last] = expected[key]
    text = yaml.safe_dump(_local_data(router=router, cluster={"run_dir": str(tmp_path)}))
    _, plan = cluster_plans(parse_topology(text, source=tmp_path / "topology.yaml"))
    ((path, rendered),) = plan.files
    Path(path).write_text(rendered)
    loaded = load_settings(path)
    assert {key: value_at(loaded, key) for key in expected} == expected


def _production(kernels: bool):
    topo = load_topology(REPO / "topology.yaml")
    if not kernels:
        topo = topo.model_copy(update={"kernels": topo.kernels.model_copy(
            update={"sparse_mla_decode": False, "indexer": False, "topk": False})})
    return topo


@pytest.mark.parametrize(("example", "devices"), [("gpu.yaml", ["cuda:0", "cuda:0"]), ("gpu2.yaml", ["cuda:0", "cuda:1"])])
def test_embedded_cuda_workers_name_their_gpu_and_see_all(example: str, devices: list[str]) -> None:
    (prefill, decode), _ = cluster_plans(load_topology(REPO / "examples" / example))
    assert [_flag(p.argv, "--device") for p in (prefill, decode)] == devices
    # every GPU visible, as for SGLang: UCX's cuda_ipc copies GPU to GPU only when the peer's GPU is visible
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env_dict and "CUDA_VISIBLE_DEVICES" not in decode.env_dict


def test_sglang_argv_env_and_pinning() -> None:
    (prefill, decode), _ = cluster_plans(_production(kernels=True))
    assert prefill.argv[:3] == (sys.executable, "-m", "sglang.launch_server")  # no numactl stacked
    a = prefill.argv
    assert _flags(a, "--numa-node") == ["0"] * 4  # indexed by GPU id, as SGLang reads it
    assert _flags(decode.argv, "--numa-node") == ["1"] * 8
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env_dict  # all GPUs visible: NIXL may copy GPU to GPU
    assert (_flag(a, "--base-gpu-id"), _flag(a, "--gpu-id-step")) == ("0", "1")
    assert _flag(decode.argv, "--base-gpu-id") == "4"
    assert prefill.env_dict["SGLANG_HOST_IP"] == decode.env_dict["SGLANG_HOST_IP"] == "127.0.0.1"
    assert (_flag(a, "--tp-size"), _flag(a, "--port"), _flag(a, "--nccl-port")) == ("4", "30100", "30110")
    assert (_flag(a, "--disaggregation-mode"), _flag(a, "--disaggregation-transfer-backend"),
            _flag(a, "--disaggregation-bootstrap-port")) == ("prefill", "nixl", "8998")
    assert (_flag(a, "--model-path"), _flag(a, "--page-size"), _flag(a, "--kv-cache-dtype")) == \
        ("deepseek-ai/DeepSeek-V4-Flash", "256", "fp8_e4m3")
    assert (_flag(a, "--reasoning-parser"), _flag(a, "--tool-call-parser")) == ("deepseek-v4", "deepseekv4")
    assert "--enable-metrics" in a and "--trust-remote-code" in a
    assert "--enable-cache-report" in a and "--enable-cache-report" in decode.argv   # usage's cached tokens
    assert _flag(decode.argv, "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in decode.argv
    assert "--max-total-tokens" not in a  # null: SGLang sizes the pool from free memory
    assert prefill.ports == (30100, 8998, 30110)


def test_sglang_plugin_env_names_the_kernels_only_when_asked() -> None:
    (prefill, decode), _ = cluster_plans(_production(kernels=True))
    topo = _production(kernels=True)
    for plan in (prefill, decode):
        env = plan.env_dict
        assert env[KERNELS_ENV] == "sparse_mla_decode,indexer,topk"
        assert env[ATTEST_DIR_ENV] == str(topo.run_dir_path / "attest" / plan.name)
        assert env[WORKER_ENV] == plan.name
    (prefill, _), _ = cluster_plans(_production(kernels=False))
    assert KERNELS_ENV not in prefill.env_dict and ATTEST_DIR_ENV not in prefill.env_dict


@pytest.mark.parametrize("topology_dtype, sglang_dtype", [("auto", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3")])
def test_sglang_kv_dtype_takes_sglang_names(topology_dtype: str, sglang_dtype: str) -> None:
    topo = _production(kernels=False)
    for w in topo.workers:
        w.kv_cache_dtype = topology_dtype
    (prefill, _), _ = cluster_plans(topo)
    assert _flag(prefill.argv, "--kv-cache-dtype") == sglang_dtype


def test_sglang_flags_are_sglang_0_5_23_flags() -> None:
    (prefill, decode), _ = cluster_plans(_production(kernels=True))
    for plan in (prefill, decode):
        argv = plan.argv[plan.argv.index("sglang.launch_server") + 1:]
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= SGLANG_0_5_23_FLAGS, flags - SGLANG_0_5_23_FLAGS
