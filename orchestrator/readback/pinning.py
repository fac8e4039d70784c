"""Pinning read back from the running process (/proc: CPU affinity, NUMA memory policy, CUDA_VISIBLE_DEVICES, and
the GPUs its group holds contexts on), compared with what its launch plan asked; `status` flags each mismatch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsv4_cluster.orchestrator.readback.gpus import read_gpus_held
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import group_members


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def node_cpus(node: int) -> set[int] | None:
    """The CPUs of NUMA node `node` on this machine (None: no such node)."""
    try:
        return parse_cpu_list(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Pinning:
    """What the process runs with."""

    cpus: str                 # affinity, as a CPU list
    numa_policy: str          # of its heap in numa_maps: "default", "bind:1", "interleave:0-1", ...
    mems_allowed: str         # Mems_allowed_list
    visible_gpus: str | None  # CUDA_VISIBLE_DEVICES, None when unset
    gpus_held: list[int] | None = None  # GPUs with a CUDA context of the process or its group; None: unknown


def _heap_policy(pid: int) -> str:
    lines = Path(f"/proc/{pid}/numa_maps").read_text().splitlines()
    heap = [ln for ln in lines if " heap" in ln] or lines[:1]
    return heap[0].split()[1] if heap and len(heap[0].split()) > 1 else "unknown"


def _status_field(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def read_pinning(pid: int) -> Pinning:
    """Raises OSError (ProcessLookupError, PermissionError, FileNotFoundError) if /proc says no."""
    return Pinning(cpus=format_cpu_list(os.sched_getaffinity(pid)), numa_policy=_heap_policy(pid),
                   mems_allowed=_status_field(pid, "Mems_allowed_list"),
                   visible_gpus=_environ(pid).get("CUDA_VISIBLE_DEVICES"),
                   gpus_held=read_gpus_held({pid, *group_members(pid)}))


def _numa_node(plan: LaunchPlan) -> int | None:
    for arg in plan.argv:
        if arg.startswith("--cpunodebind="):
            return int(arg.split("=", 1)[1])
    return None


def mismatches(plan: LaunchPlan, pinning: Pinning) -> list[str]:
    """Every difference between the plan's pinning and the process's; [] when they agree."""
    problems = []
    node = _numa_node(plan)
    if node is not None:
        want = node_cpus(node)
        if want is not None and parse_cpu_list(pinning.cpus) != want:
            problems.append(f"cpus {pinning.cpus}, NUMA node {node} has {format_cpu_list(want)}")
        if pinning.numa_policy != f"bind:{node}":
            problems.append(f"memory policy {pinning.numa_policy}, expected bind:{node}")
        if parse_cpu_list(pinning.mems_allowed) - {node}:
            problems.append(f"may allocate on NUMA nodes {pinning.mems_allowed}, expected {node}")
    gpus = plan.env_dict.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None and pinning.visible_gpus != gpus:
        problems.append(f"sees GPUs {pinning.visible_gpus!r}, expected {gpus!r}")
    if plan.gpus and pinning.gpus_held and set(pinning.gpus_held) != set(plan.gpus):   # [] = no context yet
        problems.append(f"holds CUDA contexts on GPUs {pinning.gpus_held}, expected {list(plan.gpus)}")
    return problems


def pinning_report(plan: LaunchPlan, pid: int) -> dict[str, Any]:
    """`status`'s pinning entry: what the process runs with, and `mismatch` (a list, [] = as planned)."""
    try:
        pinning = read_pinning(pid)
    except OSError as e:
        return {"error": f"cannot read /proc/{pid}: {e}", "mismatch": []}
    return {**asdict(pinning), "mismatch": mismatches(plan, pinning)}
