"""Shared vocabulary: roles, worker lifecycle states, and the status record every package speaks.

The orchestrator, the router and the CLI exchange these across process boundaries (Ray actor
calls, `status --json`), so they are plain enums and frozen dataclasses with a dict form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any


KERNEL_NAMES = ("sparse_mla_decode", "indexer", "topk")  # the custom kernels a topology can ask for


class Role(str, Enum):
    """What a supervised process does in the cluster."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"

    def __str__(self) -> str:
        """The wire form ("prefill"), in f-strings and metric labels too, on every Python version."""
        return self.value


WORKER_ROLES = (Role.PREFILL, Role.DECODE)  # the roles a topology lists workers under and the router pairs


class WorkerState(str, Enum):
    """Lifecycle of one supervised process.

    STARTING -> READY -> DRAINING -> STOPPED. READY -> DEGRADED when health probes start failing
    (still running, not paired by the router) and back to READY when they pass again;
    DEGRADED/any running state -> RESTARTING while the supervisor replaces the process;
    FAILED after a crash loop (or a start that never becomes ready), with the reason.
    Only READY workers are paired by the router.
    """

    STARTING = "STARTING"
    READY = "READY"
    DEGRADED = "DEGRADED"
    RESTARTING = "RESTARTING"
    DRAINING = "DRAINING"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


@dataclass(frozen=True)
class KvUsage:
    """KV cache capacity and usage of one engine, in tokens."""

    capacity_tokens: int
    used_tokens: int


@dataclass(frozen=True)
class StrandedKv:
    """A prefill's KV held for rooms no decode fetched (now), and what the deadline freed since it started."""

    tokens: int
    rooms: int
    freed_tokens: int
    freed_rooms: int


@dataclass(frozen=True)
class WorkerStatus:
    """One row of `dsv4-cluster status`: a supervised process as its supervisor sees it."""

    name: str
    role: Role
    node: str
    state: WorkerState | None  # None: its supervisor did not answer (`error` says why)
    pid: int | None
    port: int
    restarts: int
    kv: KvUsage | None
    log_path: str
    error: str | None = None
    kernels: tuple[tuple[str, str], ...] = ()  # (kernel, implementation) the engine reports
    log_tail: str | None = None  # the log's last lines while DEGRADED, RESTARTING or FAILED
    pinning: dict[str, Any] | None = None  # read back from /proc; "mismatch" lists differences from the plan
    stranded_kv: StrandedKv | None = None  # prefill only
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # last spawns and state changes, `at` epoch s
    kv_predicted_tokens: int | None = None  # the capacity planner's prediction (workers only)
    ray_node_id: str | None = None  # the Ray node its supervisor runs on
    reported_at: float | None = None  # when its supervisor read this row (epoch s, the supervisor's clock)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kernels"] = dict(self.kernels)
        out["role"] = self.role.value
        out["state"] = self.state.value if self.state is not None else None
        out["kv_capacity_tokens"] = self.kv.capacity_tokens if self.kv else None
        out["kv_used_tokens"] = self.kv.used_tokens if self.kv else None
        del out["kv"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerStatus:
        capacity, used = data.get("kv_capacity_tokens"), data.get("kv_used_tokens")
        kv = KvUsage(int(capacity), int(used or 0)) if capacity is not None else None
        state = data.get("state")
        return cls(
            name=data["name"], role=Role(data["role"]), node=data["node"],
            state=WorkerState(state) if state is not None else None, pid=data.get("pid"), port=int(data["port"]),
            restarts=int(data.get("restarts", 0)), kv=kv, log_path=data["log_path"], error=data.get("error"),
            kernels=tuple(sorted((data.get("kernels") or {}).items())), log_tail=data.get("log_tail"),
            pinning=data.get("pinning"),
            stranded_kv=StrandedKv(**data["stranded_kv"]) if data.get("stranded_kv") else None,
            history=list(data.get("history") or []), kv_predicted_tokens=data.get("kv_predicted_tokens"),
            ray_node_id=data.get("ray_node_id"), reported_at=data.get("reported_at"))


@dataclass(frozen=True)
class ProbeResult:
    """One deep probe of a prefill -> decode pair (a real request through both)."""

    prefill: str
    decode: str
    ok: bool
    seconds: float
    at: float  # unix time
    error: str | None = None


@dataclass(frozen=True)
class ClusterStatus:
    """What `dsv4-cluster status` shows: every supervised process, in start order, and the last deep probes."""

    endpoint: str
    workers: tuple[WorkerStatus, ...]
    probes: tuple[ProbeResult, ...] = ()

    def pids(self) -> dict[str, int | None]:
        return {w.name: w.pid for w in self.workers}

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "workers": [w.to_dict() for w in self.workers],
                "probes": [dataclasses.asdict(p) for p in self.probes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterStatus:
        return cls(data["endpoint"], tuple(WorkerStatus.from_dict(w) for w in data["workers"]),
                   tuple(ProbeResult(**p) for p in data.get("probes") or ()))
