"""What the topology rules look at: the raw parsed file as workers with their resolved values.

The rules run on the raw data, not on a validated ``Topology`` (see `rules.py`), so every accessor here
tolerates values of the wrong type and leaves them to the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

from dsv4_cluster.core import WORKER_ROLES, Role
from .schema import ENGINE_DEFAULTS, EngineName, WorkerDefaults, default_nodes

Path_ = tuple[Any, ...]


@dataclass(frozen=True)
class Finding:
    path: Path_
    message: str
    fix: str


@dataclass(frozen=True)
class WorkerEntry:
    role: Role
    index: int
    raw: dict[Any, Any]

    @property
    def path(self) -> Path_:
        return (self.role.value, self.index)

    @property
    def label(self) -> str:
        name = self.raw.get("name")
        where = f"{self.role.value}[{self.index}]"
        return f"{name} ({where})" if isinstance(name, str) else where


@dataclass(frozen=True)
class RuleContext:
    data: dict[Any, Any]
    workers: tuple[WorkerEntry, ...]
    nodes: dict[str, str]  # node name -> address, for the well-formed nodes
    first_node: str | None

    @property
    def engine(self) -> str | None:
        engine = self.data.get("engine")
        return engine if engine in get_args(EngineName) else None

    def section(self, name: str) -> dict[Any, Any]:
        value = self.data.get(name)
        return value if isinstance(value, dict) else {}

    def node_of(self, raw: dict[Any, Any]) -> str | None:
        node = raw.get("node")
        return self.first_node if node is None else node if isinstance(node, str) else None

    def host_key(self, node: str | None) -> str | None:
        """Ports and GPUs are shared per host: two node names with one address are one host."""
        return None if node is None else self.nodes.get(node, node)

    def resolved(self, worker: WorkerEntry, key: str) -> tuple[Any, Path_]:
        """The value a worker ends up with for a defaulted field, and where it was written."""
        if worker.raw.get(key) is not None:
            return worker.raw[key], worker.path + (key,)
        defaults = self.section("defaults")
        if defaults.get(key) is not None:
            return defaults[key], ("defaults", key)
        engine_default = ENGINE_DEFAULTS.get(self.engine or "", {}).get(key)
        return engine_default if engine_default is not None else WorkerDefaults.model_fields[key].default, \
            ("defaults", key)

    def written(self, worker: WorkerEntry, key: str) -> bool:
        """Whether the file sets `key` for this worker (itself or under defaults)."""
        return worker.raw.get(key) is not None or self.section("defaults").get(key) is not None


def build_context(data: dict[Any, Any]) -> RuleContext:
    workers = []
    for role in WORKER_ROLES:
        items = data.get(role.value)
        if isinstance(items, list):
            workers += [WorkerEntry(role, i, w) for i, w in enumerate(items) if isinstance(w, dict)]
    raw_nodes = data.get("nodes")
    if raw_nodes is None:
        nodes = {node.name: node.address for node in default_nodes()}
    else:
        nodes = {
            n["name"]: n["address"] if isinstance(n.get("address"), str) else n["name"]
            for n in (raw_nodes if isinstance(raw_nodes, list) else [])
            if isinstance(n, dict) and isinstance(n.get("name"), str)
        }
    return RuleContext(data, tuple(workers), nodes, next(iter(nodes), None))


def field_value(raw: dict[Any, Any], model: type[BaseModel], key: str) -> Any:
    """The raw value, or the schema's default when the key is absent."""
    return raw[key] if key in raw else model.model_fields[key].get_default(call_default_factory=True)


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
