"""Preflight: what `up` checks on this machine before it starts anything, every problem at once: ports free
(on this machine's nodes), a run folder it can write, numactl, NIXL, SGLang at the pinned version and able to find
our plugin, and each pinned worker's NUMA node the one its GPUs sit on.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from dsv4_cluster.kernels.sglang_plugin.settings import SGLANG_VERSION
from dsv4_cluster.orchestrator.launch.gpu_classes import detect_classes, gpu_workers, kernel_problems
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan, requested_kernels
from dsv4_cluster.orchestrator.launch.port_owner import port_holders
from dsv4_cluster.orchestrator.launch.ports import port_is_free
from dsv4_cluster.orchestrator.launch.sglang_capacity import checkpoint_config
from dsv4_cluster.workers.kv.nixl_loader import INSTALL_HINT as NIXL_INSTALL_HINT, nixl_package

LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")
NUMA_SYSFS = "/sys/devices/system/node"


def _is_local(address: str) -> bool:
    if address in LOCAL_HOSTS or address.startswith("127."):
        return True
    try:
        mine = {socket.gethostname(), socket.getfqdn()}
        mine |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return address in mine


def port_problems(topology: Any, plans: list[LaunchPlan]) -> list[str]:
    problems = []
    for plan in plans:
        if not _is_local(topology.node(plan.node).address):
            continue
        for port in plan.ports:
            if not port_is_free(port):
                holders = port_holders(port)
                by = f" by {', '.join(holders)}" if holders else " (by a process this user cannot inspect)"
                problems.append(f"{plan.name}: port {port} is in use on this machine{by} — stop it "
                                "or pick another port in the topology")
    return problems


def _visible_gpus() -> int:
    import torch  # only when a local worker wants a GPU: importing torch takes seconds

    return torch.cuda.device_count()


def hardware_problems(topology: Any) -> list[str]:
    """GPUs and NUMA nodes that local workers ask for and this machine lacks."""
    problems = []
    local = [w for w in topology.workers if _is_local(topology.node(w.node).address)]
    for w in local:
        if w.numa_node is not None and not Path(f"{NUMA_SYSFS}/node{w.numa_node}").exists():
            problems.append(f"{w.name}: numa_node {w.numa_node} does not exist on this machine "
                            f"(see {NUMA_SYSFS}) — pick an existing node or remove numa_node")
    wanted = [w for w in local if w.device == "cuda"]
    if wanted:
        count = _visible_gpus()
        for w in wanted:
            missing = [g for g in w.gpus if g >= count]
            if missing or not w.gpus:
                problems.append(f"{w.name}: wants GPUs {w.gpus or '(none listed)'} but this machine "
                                f"shows {count} CUDA device(s) — fix gpus or device")
    return problems


PLUGIN_ENTRY_POINT = "dsv4_cluster.kernels.sglang_plugin:register"


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node sysfs gives for CUDA device `index` (None when unknown: -1, no file, no GPU)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def numa_mismatches(workers: list[Any], numa_of_gpu: Any) -> list[str]:
    """Workers whose numa_node is not their GPUs' node: SGLang would bind TP children away from the GPU."""
    problems = []
    for w in workers:
        if w.numa_node is None:
            continue
        wrong = {g: n for g in w.gpus if (n := numa_of_gpu(g)) is not None and n != w.numa_node}
        if wrong:
            found = ", ".join(f"GPU {g} on node {n}" for g, n in wrong.items())
            problems.append(f"{w.name}: numa_node {w.numa_node}, but {found} (sysfs); SGLang binds each TP child "
                            f"to numa_node, away from its GPU — set numa_node to the GPUs' node")
    return problems


def sglang_problems(topology: Any) -> list[str]:
    """The plugin SGLang must find for the kernels, and the topology's NUMA nodes against the GPUs'."""
    problems = []
    kernels = requested_kernels(topology)
    plugins = {ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    if kernels and PLUGIN_ENTRY_POINT not in plugins:
        problems.append(f"kernels {', '.join(kernels)} requested but SGLang will not find the dsv4-cluster plugin "
                        "(entry point group sglang.srt.plugins) — reinstall this project (pip install -e .)")
    if "sparse_mla_decode" in kernels and model_type(topology.model.path) == DSV41_MODEL_TYPE:
        problems.append(f"kernels.sparse_mla_decode: the checkpoint at {topology.model.path} is DeepSeek-V4.1 "
                        f"(config.json model_type {DSV41_MODEL_TYPE}), whose KV rows (528 / 288 bytes) are not the "
                        "584-byte V4 rows the decode kernel reads — set kernels.sparse_mla_decode: false")
    local = [w for w in topology.workers if _is_local(topology.node(w.node).address) and w.device == "cuda"]
    if any(w.numa_node is not None for w in local) and _visible_gpus() > max(g for w in local for g in w.gpus):
        problems += numa_mismatches(local, gpu_numa_node)
    return problems


DSV41_MODEL_TYPE = "deepseek_v41"  # SGLang 0.5.23: models/deepseek_v4.py sets is_dsv41 from it


def model_type(model_path: Any) -> str | None:
    """`model_type` of a local checkpoint folder's config.json (None: no such file, e.g. a hub name, or one that
    is not a JSON object: the capacity planner names that error)."""
    try:
        config = checkpoint_config(model_path)
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def machine_problems(topology: Any) -> list[str]:
    problems = hardware_problems(topology)
    pinned = [w.name for w in topology.workers if w.numa_node is not None]
    if pinned and shutil.which("numactl") is None:
        problems.append(f"{', '.join(pinned)}: numa_node is set but `numactl` is not installed (the embedded "
                        "engine runs under it; SGLang binds its TP children with it) — "
                        "apt-get install -y numactl, or remove numa_node")
    if str(topology.transfer.backend) == "nixl" and nixl_package() is None:
        problems.append(f"transfer.backend is nixl but NIXL is not importable — {NIXL_INSTALL_HINT}")
    if str(topology.engine) == "sglang":
        try:
            found = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"engine is sglang but SGLang is not installed — pip install "
                            f"sglang=={SGLANG_VERSION}, or use engine: embedded")
        else:
            if found != SGLANG_VERSION:
                problems.append(f"engine is sglang: found SGLang {found}, the launch flags are "
                                f"checked against {SGLANG_VERSION} — pip install sglang=={SGLANG_VERSION}")
        problems += sglang_problems(topology)
    return problems


def kernel_class_problems(topology: Any) -> list[str]:
    """Requested kernels that this machine's GPUs' class cannot take (gpu_classes.py: fail closed before start)."""
    local = [w for w in gpu_workers(topology) if w.gpus and _is_local(topology.node(w.node).address)]
    if not local:
        return []
    classes = detect_classes()
    return [] if classes is None else kernel_problems(topology, classes, local)   # no driver: hardware_problems


def run_dir_problems(topology: Any) -> list[str]:
    """`cluster.run_dir` must take the logs (the Ray head's first): checked before anything starts, so that a path
    this user cannot write is a problem named, not a traceback once the head starts. Nothing is made here (a failed
    preflight leaves no folder behind): the head's start and the supervisors make what they write in."""
    logs = Path(topology.run_dir_path) / "logs"
    existing = next(p for p in (logs, *logs.parents) if p.exists() or p.is_symlink())   # a dangling link: no folder
    if not existing.is_dir():
        problem = f"cannot create {logs} ({existing} is not a folder)"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"this user cannot write in {existing}"
    else:
        return []
    return [f"cluster.run_dir {topology.run_dir_path}: {problem} — pick a folder this user can write"]


def preflight(topology: Any, plans: list[LaunchPlan]) -> list[str]:
    """Every problem that would stop the cluster from starting here; empty when none."""
    return (machine_problems(topology) + kernel_class_problems(topology) + run_dir_problems(topology)
            + port_problems(topology, plans))
