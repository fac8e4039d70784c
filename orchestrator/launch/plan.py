"""Launch plans: the exact argv, env, log file and readiness probes of every supervised process.

Computed from the topology alone, before anything starts, so a plan can be printed, tested flag by flag and
shipped to a supervisor as one frozen value. The router's settings travel typed in its plan (`router_settings`),
and its supervisor writes them out; nothing parses them back.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_cluster.core import KERNEL_NAMES, Role
from dsv4_cluster.orchestrator.launch.sglang import sglang_argv, sglang_env
from dsv4_cluster.router.settings import DecodeEndpoint, OperatorSettings, PrefillEndpoint, RouterSettings

if TYPE_CHECKING:
    from dsv4_cluster.orchestrator.topology.schema import Topology, WorkerConfig

ROUTE_PROBE = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


@dataclass(frozen=True)
class LaunchPlan:
    """How to start one process and how to know it is ready."""

    name: str
    role: Role
    node: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str
    log_path: str
    port: int
    health_url: str
    readiness_urls: tuple[str, ...] = ()
    server_info_url: str | None = None
    metrics_url: str | None = None
    ports: tuple[int, ...] = field(default=())
    files: tuple[tuple[str, str], ...] = ()  # (path, text) the supervisor writes before spawning
    tp: int = 1  # processes that serve it (SGLang: one per TP rank); each attests its kernels
    gpus: tuple[int, ...] = ()  # the topology's GPU indices for it (status compares what it holds)
    router_settings: RouterSettings | None = None  # the router's: what its `files` entry renders

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def all_readiness_urls(self) -> tuple[str, ...]:
        return (self.health_url, *self.readiness_urls)


def requested_kernels(topology: Topology) -> tuple[str, ...]:
    return tuple(k for k in KERNEL_NAMES if getattr(topology.kernels, k))


def _probe_host(address: str, bind_host: str) -> str:
    """Where the orchestrator reaches a server that binds `bind_host` on a node at `address`."""
    return address if bind_host in ("0.0.0.0", "::", "") else bind_host


def _log_path(topology: Topology, name: str) -> str:
    return str(Path(topology.run_dir_path) / "logs" / f"{name}.log")


def _numactl_prefix(topology: Topology, worker: WorkerConfig) -> list[str]:
    """numactl for the embedded engine; SGLang binds its TP children itself (`--numa-node`)."""
    if worker.numa_node is None or topology.engine == "sglang":
        return []
    n = str(worker.numa_node)
    return ["numactl", f"--cpunodebind={n}", f"--membind={n}"]


def _worker_env(topology: Topology, worker: WorkerConfig) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if topology.engine == "sglang":
        env.update(sglang_env(topology, worker, requested_kernels(topology)))
    # embedded workers too keep every GPU visible and name theirs (--device cuda:N): UCX's cuda_ipc needs the
    # peer's GPU visible to copy GPU to GPU (hidden, it stages through host memory or fails)
    if topology.transfer.ucx_tls:
        env["UCX_TLS"] = topology.transfer.ucx_tls
    return env


def embedded_device(worker: WorkerConfig) -> str:
    """The worker's --device: cpu, or cuda:N for its one GPU N (the topology's index, all GPUs visible)."""
    device = worker.device
    return f"cuda:{worker.gpus[0]}" if device == "cuda" and worker.gpus else device


def embedded_argv(topology: Topology, worker: WorkerConfig) -> list[str]:
    role = worker.role.value
    # the node's own address (what peers and the router use), never 0.0.0.0: a worker has no auth of its own
    argv = [sys.executable, "-m", f"dsv4_cluster.workers.{role}", "--host", topology.node(worker.node).address,
            "--port", str(worker.port)]
    if role == Role.PREFILL.value:
        argv += ["--disaggregation-bootstrap-port", str(worker.bootstrap_port),
                 "--peer-timeout-s", str(topology.transfer.stranded_kv_timeout_s),
                 "--write-timeout-s", str(topology.transfer.write_timeout_s)]
    argv += [
        "--served-model-name", topology.model.name,
        "--seed", str(topology.model.seed),
        "--context-length", str(topology.model.context_length),
        "--page-size", str(worker.page_size),
        "--kv-cache-dtype", str(worker.kv_cache_dtype),
    ]
    if worker.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(worker.max_total_tokens)]
    argv += [
        "--transfer-backend", topology.transfer.backend,
        "--device", embedded_device(worker),
        "--node-address", topology.node(worker.node).address,
    ]
    if topology.transfer.ucx_tls:
        argv += ["--ucx-tls", topology.transfer.ucx_tls]
    kernels = requested_kernels(topology)
    if kernels:
        argv += ["--kernels", ",".join(kernels)]
    return argv + [str(a) for a in worker.extra_args]


def worker_plan(topology: Topology, worker: WorkerConfig) -> LaunchPlan:
    """The plan of one prefill or decode worker, for either engine."""
    argv = sglang_argv(topology, worker) if topology.engine == "sglang" else embedded_argv(topology, worker)
    role = worker.role
    host = topology.node(worker.node).address
    base = f"http://{host}:{worker.port}"
    readiness: tuple[str, ...] = ()
    ports: tuple[int, ...] = (worker.port,)
    if role is Role.PREFILL:
        boot = f"http://{host}:{worker.bootstrap_port}"
        readiness = (f"{boot}/health", f"{boot}{ROUTE_PROBE}")
        ports += (worker.bootstrap_port,)
    if worker.nccl_port is not None:
        ports += (worker.nccl_port,)
    return LaunchPlan(
        name=worker.name,
        role=role,
        node=worker.node,
        argv=tuple(_numactl_prefix(topology, worker) + argv),
        env=tuple(sorted(_worker_env(topology, worker).items())),
        cwd=str(topology.run_dir_path),
        log_path=_log_path(topology, worker.name),
        port=worker.port,
        health_url=f"{base}/health",
        readiness_urls=readiness,
        server_info_url=f"{base}/server_info",
        metrics_url=f"{base}/metrics",
        ports=ports,
        tp=worker.tp,
        gpus=tuple(worker.gpus or ()),
    )


def router_settings(topology: Topology) -> RouterSettings:
    """The router's settings: every setting of the topology's `router:` section as written (it is the router's
    `OperatorSettings`), and what the orchestrator derives: the model's name, every worker at its node's address,
    the API keys' source (the admin token is added at `up`, `supervise/router_admin.py`)."""
    r = topology.router
    prefill = [PrefillEndpoint(name=w.name, url=f"http://{topology.node(w.node).address}:{w.port}",
                               bootstrap_host=topology.node(w.node).address, bootstrap_port=w.bootstrap_port)
               for w in topology.prefill]
    decode = [DecodeEndpoint(name=w.name, url=f"http://{topology.node(w.node).address}:{w.port}")
              for w in topology.decode]
    keys: dict[str, Any] = {}
    if r.api_keys is not None and r.api_keys.file is not None:
        keys["api_keys_file"] = str(_beside(topology, r.api_keys.file))
    elif r.api_keys is not None:
        keys["api_keys_env"] = r.api_keys.env
    operator = {name: getattr(r, name) for name in OperatorSettings.model_fields}
    return RouterSettings(**operator, model_name=topology.model.name, context_length=topology.model.context_length,
                          prefill=prefill, decode=decode, **keys)


def _beside(topology: Topology, path: str) -> Path:
    """A path of the topology made absolute against the topology file's folder (else the cwd)."""
    p = Path(path).expanduser()
    base = topology.source.parent if topology.source is not None else Path.cwd()
    return p if p.is_absolute() else (base / p).resolve()


def router_config_path(topology: Topology) -> Path:
    return Path(topology.run_dir_path) / "router.json"


def with_router_settings(router: LaunchPlan, settings: RouterSettings) -> LaunchPlan:
    """The router's plan carrying `settings`, rendered into the settings file it writes (argv's --config)."""
    config = router.argv[-1]
    return dataclasses.replace(router, router_settings=settings,
                               files=((config, settings.model_dump_json(indent=2) + "\n"),))


def router_plan(topology: Topology) -> LaunchPlan:
    """The router's plan, carrying its settings."""
    r = topology.router
    host = _probe_host(topology.node(r.node).address, r.host)
    config = str(router_config_path(topology))
    plan = LaunchPlan(
        name=Role.ROUTER.value,   # the topology refuses it as a worker's name
        role=Role.ROUTER,
        node=r.node,
        argv=(sys.executable, "-m", "dsv4_cluster.router", "--config", config),
        env=(("PYTHONUNBUFFERED", "1"),),
        cwd=str(topology.run_dir_path),
        log_path=_log_path(topology, "router"),
        port=r.port,
        health_url=f"http://{host}:{r.port}/health",
        ports=(r.port,),
    )
    return with_router_settings(plan, router_settings(topology))


def endpoint(topology: Topology) -> str:
    """The URL a client on this machine uses: the router's bind address, or localhost where it binds every address
    (0.0.0.0 / ::), which no client can connect to by that name."""
    r = topology.router
    host = "localhost" if str(r.host) in ("0.0.0.0", "::", "") else str(r.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{r.port}/v1"


def cluster_plans(topology: Topology) -> tuple[list[LaunchPlan], LaunchPlan]:
    """Every worker's plan (prefill then decode) and the router's."""
    return [worker_plan(topology, w) for w in topology.workers], router_plan(topology)
