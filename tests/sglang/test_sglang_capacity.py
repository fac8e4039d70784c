"""SGLang 0.5.23's DeepSeek-V4 KV pool sizing (`orchestrator/launch/sglang_capacity.py`) against SGLang's own code.

The child process resolves each server's argv with SGLang, builds a real `KVCacheConfigurator` and its
`DSV4PoolConfigurator`, runs `_resolve_memory_pool_config` with the measured inputs fed in (free GPU
memory is measured at start; here it is an input), and builds `DeepSeekV4TokenToKVPool` on device
"meta". Our numbers must equal SGLang's: per-token bytes, available bytes, max_total_num_tokens.
"""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.launch import sglang_capacity as sg
from dsv4_cluster.orchestrator.launch.plan import cluster_plans
from dsv4_cluster.orchestrator.topology.load import load_topology
from dsv4_cluster.orchestrator.launch.capacity import predict
from tests.sglang_support import REPO, child_result, require_sglang, server_argv, start_child
from tests.zygote import Started

require_sglang()

H200_MIB, H100_MIB = 143771.0, 81559.0


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv[-2:-2] = [flag, value]  # before the trailing --device cuda
    return argv


def _case(role: str, gpu_mib: float, *, tp: int = 4, context: int = 131072, fraction: float | None = None,
          max_total_tokens: int | None = None, checkpoint_gib: float = 149.0) -> dict:
    workers, _ = cluster_plans(load_topology(REPO / "topology.yaml"))
    plan = next(p for p in workers if p.role.value == role)
    argv = _set(_set(server_argv(plan), "--tp-size", str(tp)), "--context-length", str(context))
    if fraction is not None:
        argv = _set(argv, "--mem-fraction-static", str(fraction))
    if max_total_tokens is not None:
        argv = _set(argv, "--max-total-tokens", str(max_total_tokens))
    gpu = sg.GpuInputs(gpu_mib, None, checkpoint_gib)
    pre, weights = gpu.pre_gib(), gpu.weights_gib(tp)
    return {"argv": argv, "gpu_total_mib": gpu_mib, "pre_gib": pre, "free_after_load_gib": pre - weights,
            "ours": {"role": role, "tp": tp, "fraction": fraction,
                     "max_total_tokens": max_total_tokens, "pre": pre, "weights": weights}}


CASES = {
    "production decode, SGLang's default fraction": _case("decode", H200_MIB),
    "production prefill, SGLang's default fraction": _case("prefill", H200_MIB),
    "decode TP8, 1M context, 0.85": _case("decode", H200_MIB, tp=8, context=1048576, fraction=0.85),
    "prefill TP2, 64K context, 0.80, capped": _case("prefill", H200_MIB, tp=2, context=65536, fraction=0.80,
                                                    max_total_tokens=500_000),
    "decode on an 80 GiB GPU, default fraction": _case("decode", H100_MIB, checkpoint_gib=149.0 * 0.6),
    "prefill on an 80 GiB GPU, 0.9": _case("prefill", H100_MIB, fraction=0.9, checkpoint_gib=149.0 * 0.6),
}


TOPOLOGY = load_topology(REPO / "topology.yaml")
WORKERS, _ = cluster_plans(TOPOLOGY)
PREDICTED = {p.name: predict(TOPOLOGY, TOPOLOGY.worker(p.name)).max_total_num_tokens for p in WORKERS}
# what SGLang's /server_info says: the prefill within 5% of the prediction, the decode 8% under it
ACTUAL = {"prefill-0": PREDICTED["prefill-0"] - 256, "decode-0": int(PREDICTED["decode-0"] * 0.92)}


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, Started]]:
    """The module's two SGLang children (SGLang imports take ~20 s of one core each), started together:
    every case sized by SGLang's own classes; the /server_info bodies SGLang builds for ACTUAL."""
    procs = {"capacity": start_child("capacity", json.dumps([{k: v for k, v in c.items() if k != "ours"}
                                                             for c in CASES.values()])),
             "server_info": start_child("server_info", json.dumps([[server_argv(p), ACTUAL[p.name]] for p in WORKERS]))}
    try:
        yield procs
    finally:
        for c in procs.values():
            c.kill()


@pytest.fixture(scope="module")
def sglang_sized(children: dict[str, Started]) -> dict[str, dict]:
    """Every case sized by SGLang's own classes, in one child."""
    return dict(zip(CASES, child_result(children["capacity"])))


def _ours(case: dict) -> tuple[float, sg.PoolSize]:
    o = case["ours"]
    fraction = o["fraction"] if o["fraction"] is not None else \
        sg.default_mem_fraction(case["gpu_total_mib"], Role(o["role"]), o["tp"])
    available = sg.available_bytes(o["pre"], o["weights"], fraction)
    pool = sg.size_pool(sg.DSV4_FLASH, available=available, mem_fraction=fraction, max_total_tokens=o["max_total_tokens"],
                        pre_gib=o["pre"], weights_gib=o["weights"])
    return fraction, pool


@pytest.mark.parametrize("name", list(CASES))
def test_pool_size_equals_sglangs(name: str, sglang_sized: dict[str, dict]) -> None:
    theirs = sglang_sized[name]
    fraction, ours = _ours(CASES[name])
    assert theirs["configurator"] == "DSV4PoolConfigurator"
    assert fraction == theirs["mem_fraction_static"]
    assert ours.available_bytes == theirs["available_bytes"]
    assert (ours.bytes_per_full_token, ours.bytes_per_swa_token) == \
        (theirs["bytes_per_full_token"], theirs["bytes_per_swa_token"])
    assert ours.fixed_bytes == theirs["c128_state_bytes"]
    assert ours.max_total_num_tokens == theirs["max_total_num_tokens"]
    assert ours.swa_tokens == theirs["swa_max_total_num_tokens"]
    assert ours.max_running_requests == theirs["max_running_requests"]
    # The pool SGLang builds (on "meta") takes what the sizing accounted, plus the page each sub-pool keeps
    # in reserve (SGLang's sizing leaves it out too): within 32 MiB.
    assert 0 <= theirs["meta_pool_bytes"] - ours.pool_bytes <= 32 << 20


def test_the_cap_and_the_default_fractions_are_what_sglang_chose(sglang_sized: dict[str, dict]) -> None:
    """The inputs differ where it matters: a capped pool, and two different default fractions."""
    assert sglang_sized["prefill TP2, 64K context, 0.80, capped"]["max_total_num_tokens"] == 499_968  # pages
    defaults = {sglang_sized[n]["mem_fraction_static"] for n in CASES if "default" in n}
    assert len(defaults) == 3


def test_status_reads_sglangs_server_info_and_flags_a_miss_over_5_percent(children: dict[str, Started]) -> None:
    """`status`'s SGLang branch: the capacity comes from a /server_info body built by SGLang 0.5.23's own
    functions (the child), read by the supervisor's probe over HTTP; the prediction is the plan's."""
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from dsv4_cluster.core import ClusterStatus, Role, WorkerState, WorkerStatus
    from dsv4_cluster.orchestrator.supervise.status_endpoint import predicted_capacity, with_predicted_capacity
    from dsv4_cluster.orchestrator.readback.probe import engine_info
    from dsv4_cluster.orchestrator.cli.table import render_table
    from tests.servers import UvicornThread

    topology, predicted, actual = TOPOLOGY, PREDICTED, ACTUAL
    assert predicted == {"prefill-0": 13100800, "decode-0": 13564928}  # H200, SGLang's default fractions
    answers = child_result(children["server_info"])
    bodies = {p.name: body for p, body in zip(WORKERS, answers)}
    rows = []
    for name, body in bodies.items():
        assert body["version"] == "0.5.23" and body["internal_states"][0]["memory_usage"]["token_capacity"] \
            == actual[name]
        app = FastAPI()
        app.get("/server_info")(lambda body=body: body)
        app.get("/metrics", response_class=PlainTextResponse)(lambda: "sglang:num_used_tokens 512.0\n")
        with UvicornThread(app) as server, httpx.Client(timeout=10) as client:
            info = engine_info(client, f"{server.url}/server_info", f"{server.url}/metrics")
        rows.append(with_predicted_capacity(WorkerStatus(name, Role(name.split("-")[0]), "local", WorkerState.READY,
                                                         1, 1, 0, info.kv, "/x.log"), predicted_capacity(topology)))
    status = ClusterStatus("e", tuple(rows))
    prefill, decode = status.workers
    assert (prefill.kv.capacity_tokens, prefill.kv_predicted_tokens, prefill.error) == \
        (actual["prefill-0"], predicted["prefill-0"], None)
    assert decode.error == (f"KV capacity {actual['decode-0']} tokens differs from the predicted "
                               f"{predicted['decode-0']} by 8% (over 5%)")
    table = render_table(status).splitlines()
    assert table[0].split()[-3:] == ["KV_CAPACITY", "KV_USED", "KV_PREDICTED"]
    assert table[2].split()[-3:] == [str(actual["decode-0"]), "512", str(predicted["decode-0"])]
    assert table[-1].startswith("decode-0: KV capacity")
