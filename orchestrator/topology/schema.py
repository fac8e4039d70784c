"""The topology schema, strict (unknown keys rejected, no coercion: "8998" is not a port) because a silently ignored
typo surfaces minutes later as an SGLang crash. Cross-field rules are in `rules.py`. After validation each worker
has `role`, `node`, `page_size`, `kv_cache_dtype` and `max_total_tokens` resolved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from dsv4_cluster.core import WORKER_ROLES, Role
from dsv4_cluster.orchestrator.launch.sglang_facts import DSV4_PAGE_SIZE
from dsv4_cluster.router.settings import OperatorSettings
from .errors import UnknownNameError

EngineName = Literal["embedded", "sglang"]
KvCacheDtype = Literal["auto", "bf16", "fp8_e4m3"]
Device = Literal["cpu", "cuda"]
TransferBackend = Literal["nixl", "tcp"]

_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"


class _Strict(BaseModel):
    """Unknown keys are errors, and YAML strings are never coerced to numbers or booleans."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ModelConfig(_Strict):
    name: str = Field(min_length=1, description='served model name (the OpenAI "model" field)')
    path: str | None = Field(default=None, description="sglang: HF id or local path of the weights")
    seed: int = Field(default=0, ge=0, description="embedded: seed of the random weights")
    context_length: int = Field(ge=1, description="max tokens of one request, prompt + output")


class ClusterConfig(_Strict):
    address: str | None = Field(
        default=None,
        pattern=r"^[^\s:/]+:[0-9]{1,5}$",
        description='Ray address to join ("host:port"); null starts a local head on 127.0.0.1',
    )
    namespace: str = Field(default="dsv4-cluster", min_length=1)
    run_dir: str = Field(default=".dsv4-cluster", min_length=1, description="relative to the topology file's folder")


class NodeConfig(_Strict):
    name: str = Field(pattern=_NAME_PATTERN)
    address: str = Field(min_length=1, description="address other workers reach this node on")


def default_nodes() -> list[NodeConfig]:
    """One node, ``local`` at 127.0.0.1: what a topology without ``nodes`` runs on."""
    return [NodeConfig(name="local", address="127.0.0.1")]


class ApiKeysConfig(_Strict):
    """Where the router's API keys are: never in the topology itself. Read by the router at its start."""

    file: str | None = Field(default=None, min_length=1, description="one key per line ('#' comments); relative "
                                                                      "to the topology file's folder")
    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                            description="an environment variable of the router's process holding the keys, "
                                        "comma-separated (the environment `up` runs in, when it starts Ray)")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeysConfig:
        if (self.file is None) == (self.env is None):
            raise ValueError("give exactly one of api_keys.file or api_keys.env (keys are never written inline)")
        return self


class RouterConfig(OperatorSettings):
    """The `router:` section: the router's own `OperatorSettings` (every setting, limit and description declared
    there, once), plus where the router runs and where its API keys come from. What the orchestrator derives for
    the router's settings file (`DERIVED`) is refused here, saying where it comes from."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # RouterSettings' fields beyond OperatorSettings, and where `launch/plan.py`'s router_settings takes each from
    DERIVED: ClassVar[dict[str, str]] = {
        "model_name": "it is model.name",
        "context_length": "it is model.context_length",
        "prefill": "the prefill workers are listed under prefill:",
        "decode": "the decode workers are listed under decode:",
        "admin_token": "`up` makes one for the cluster's own calls",
        "api_keys_file": "name the file as router.api_keys.file",
        "api_keys_env": "name the variable as router.api_keys.env",
    }

    node: str | None = Field(default=None, description="null → the first node; resolved after load")
    api_keys: ApiKeysConfig | None = Field(default=None, description="without it, no API key is asked for")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _no_inline_keys(cls, value: Any) -> Any:
        if isinstance(value, (list, str)):
            raise ValueError("API keys are never written in the topology; name where they are: api_keys.file "
                             "(a file, one key per line) or api_keys.env (an environment variable)")
        return value


class TransferConfig(_Strict):
    backend: TransferBackend = "nixl"
    ucx_tls: str | None = Field(default=None, min_length=1, description='UCX_TLS, e.g. "rc,cuda_copy"')
    stranded_kv_timeout_s: float = Field(
        default=30.0, gt=0, description="embedded: a prefill frees the KV of a prompt no decode reserved "
                                        "within this many seconds (stranded KV); SGLang has its own timeouts")
    write_timeout_s: float = Field(
        default=30.0, gt=0, description="embedded: a prefill cancels a KV write still in flight after this many "
                                        "seconds (a decode that died or froze mid-write) and frees its pages")


class KernelsConfig(_Strict):
    sparse_mla_decode: bool = True
    indexer: bool = True
    topk: bool = True


# What a worker gets when neither it nor `defaults` says. SGLang 0.5.23 runs DeepSeek-V4 with 256-token
# pages whatever it is told and fp8 KV for "auto" (orchestrator/launch/sglang.py); the embedded engine
# keeps float32 KV ("auto") in 64-token pages.
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sglang": {"page_size": DSV4_PAGE_SIZE, "kv_cache_dtype": "fp8_e4m3"},
    "embedded": {"page_size": 64, "kv_cache_dtype": "auto"},
}


class WorkerDefaults(_Strict):
    page_size: int | None = Field(default=None, ge=1, description="null → the engine's page size")
    kv_cache_dtype: KvCacheDtype | None = Field(default=None, description="null → the engine's KV dtype")
    max_total_tokens: int | None = Field(default=None, ge=1, description="KV pool capacity in tokens")


class WorkerConfig(_Strict):
    name: str = Field(pattern=_NAME_PATTERN)
    role: Role = Field(description="set by the loader from the list the worker is in")
    node: str | None = Field(default=None, description="null → the first node; resolved after load")
    device: Device = "cpu"
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, description="GPU indices on the node")
    tp: int = Field(default=1, ge=1)
    numa_node: int | None = Field(default=None, ge=0)
    port: int = Field(ge=1, le=65535)
    nccl_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    page_size: int | None = Field(default=None, ge=1, description="null → defaults.page_size")
    kv_cache_dtype: KvCacheDtype | None = None
    max_total_tokens: int | None = Field(default=None, ge=1)
    extra_args: list[str] = Field(default_factory=list)


RESOLVED_FROM_DEFAULTS = ("page_size", "kv_cache_dtype", "max_total_tokens")


class Topology(_Strict):
    engine: EngineName
    model: ModelConfig
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    nodes: list[NodeConfig] = Field(default_factory=default_nodes, min_length=1)
    router: RouterConfig = Field(default_factory=RouterConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    defaults: WorkerDefaults = Field(default_factory=WorkerDefaults)
    prefill: list[WorkerConfig] = Field(min_length=1)
    decode: list[WorkerConfig] = Field(min_length=1)

    _source: Path | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _set_roles(cls, data: Any) -> Any:
        """A worker's role is the list it is in (a differing ``role`` is a rule error); ``nodes: null`` = default."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "nodes" in data and data["nodes"] is None:
            del data["nodes"]
        for role in WORKER_ROLES:
            workers = data.get(role.value)
            if isinstance(workers, list):
                data[role.value] = [{**w, "role": role} if isinstance(w, dict) else w for w in workers]
        return data

    @model_validator(mode="after")
    def _resolve(self) -> Topology:
        first_node = self.nodes[0].name
        if self.router.node is None:
            self.router = self.router.model_copy(update={"node": first_node})
        for worker in self.workers:
            if worker.node is None:
                worker.node = first_node
            for key in RESOLVED_FROM_DEFAULTS:
                if getattr(worker, key) is None:
                    setattr(worker, key, getattr(self.defaults, key))
            for key, value in ENGINE_DEFAULTS[self.engine].items():
                if getattr(worker, key) is None:
                    setattr(worker, key, value)
        return self

    @property
    def source(self) -> Path | None:
        """The file this topology was loaded from (None when built from text or data)."""
        return self._source

    @property
    def workers(self) -> list[WorkerConfig]:
        """Every worker: prefill then decode, each in file order."""
        return [*self.prefill, *self.decode]

    def worker(self, name: str) -> WorkerConfig:
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise UnknownNameError("worker", name, [w.name for w in self.workers])

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise UnknownNameError("node", name, [n.name for n in self.nodes])

    @property
    def run_dir_path(self) -> Path:
        """``cluster.run_dir`` made absolute against the topology file's folder (else the cwd)."""
        run_dir = Path(self.cluster.run_dir).expanduser()
        if not run_dir.is_absolute():
            base = self._source.parent if self._source is not None else Path.cwd()
            run_dir = base / run_dir
        return run_dir.resolve()
