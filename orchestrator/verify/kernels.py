"""Proof that the requested kernels run in every TP process of an SGLang worker, from the plugin's files
(kernels/sglang_plugin/attestation.py): `tp` attestations from live processes of the supervised group, at the
pinned versions, every requested kernel installed; and every kernel's device counter rising on every decode rank
between two snapshots. The files live on the worker's node; this runs where they can be read.
"""

from __future__ import annotations

from pathlib import Path

from dsv4_cluster.kernels.sglang_plugin.attestation import (
    STOCK_DECODE, Attestation, attestation_path, counters_path, read_json)
from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, SGLANG_VERSION
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import group_members

Counts = dict[int, dict[str, int]]  # rank -> kernel -> calls


def attestation_problems(worker: str, folder: str | Path, tp: int, requested: tuple[str, ...],
                         server_pid: int | None, gpu_class: str | None = None) -> list[str]:
    """Why the attestations under `folder` do not prove `requested` in all `tp` ranks; empty when they do.
    `gpu_class`: the class of the worker's GPUs as read here (None: unknown, not checked); each rank must name
    it, and hold ours for every requested kernel, as the dispatch table has it for every class."""
    if not requested:
        return []
    if server_pid is None:
        return [f"{worker}: not running, so no rank can attest kernels {', '.join(requested)}"]
    live = set(group_members(server_pid))
    problems = []
    for rank in range(tp):
        data = read_json(attestation_path(folder, rank))
        if data is None:
            problems.append(f"{worker}: rank {rank} wrote no attestation ({attestation_path(folder, rank)}): "
                            f"kernels {', '.join(requested)} are not proven there")
            continue
        try:
            att = Attestation.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"{worker}: rank {rank}'s attestation is unreadable ({e})")
            continue
        if att.pid not in live:
            problems.append(f"{worker}: rank {rank}'s attestation is from pid {att.pid}, which is not a live "
                            f"process of the supervised server (pid {server_pid})")
            continue
        if att.sglang_version != SGLANG_VERSION:
            problems.append(f"{worker}: rank {rank} runs SGLang {att.sglang_version}, not {SGLANG_VERSION}")
        if gpu_class is not None and att.gpu_class != gpu_class:
            problems.append(f"{worker}: rank {rank} installed for GPU class {att.gpu_class or '(none named)'}, but its "
                            f"GPUs are {gpu_class}: the call sites it replaced are not the ones SGLang calls there")
        for kernel in requested:
            if not att.call_sites.get(kernel):
                problems.append(f"{worker}: rank {rank}: kernel {kernel} was requested but no call site holds it")
            elif att.kernels and att.kernels.get(kernel) != "ours":
                problems.append(f"{worker}: rank {rank}: kernel {kernel} runs {att.kernels.get(kernel, 'unknown')} "
                                f"on {att.gpu_class}, where the dispatch table runs ours")
    return problems


def read_counts(folder: str | Path, tp: int) -> Counts:
    """The latest published counters of each rank that has published any."""
    counts: Counts = {}
    for rank in range(tp):
        data = read_json(counters_path(folder, rank))
        if data is not None and isinstance(data.get("counts"), dict):
            counts[rank] = {str(k): int(v) for k, v in data["counts"].items()}
    return counts


def counter_problems(worker: str, tp: int, requested: tuple[str, ...], before: Counts, after: Counts) -> list[str]:
    """Which (rank, kernel) counters did not rise between the snapshots; empty when all did."""
    problems = []
    for rank in range(tp):
        if rank not in after:
            problems.append(f"{worker}: rank {rank} publishes no kernel counters")
            continue
        for kernel in requested:
            old, new = before.get(rank, {}).get(kernel, 0), after[rank].get(kernel, 0)
            if kernel == "sparse_mla_decode":  # the routed decode counts the calls it left stock apart
                old += before.get(rank, {}).get(STOCK_DECODE, 0)
                new += after[rank].get(STOCK_DECODE, 0)
            if new <= old:
                problems.append(f"{worker}: rank {rank}: kernel {kernel} was not called during the decode steps "
                                f"(counter {old} -> {new}); the stock kernel ran instead")
    return problems


def attested_kernels(plan: LaunchPlan, server_pid: int | None) -> tuple[tuple[str, str], ...]:
    """`status`'s kernels of an SGLang worker: each requested kernel as "dsv4-cluster" when every rank
    attests it from a live process, else as "unproven"; () for a worker whose ranks do not attest."""
    env = plan.env_dict
    requested = tuple(k for k in env.get(KERNELS_ENV, "").split(",") if k)
    if not requested or ATTEST_DIR_ENV not in env:
        return ()
    proven = not attestation_problems(plan.name, env[ATTEST_DIR_ENV], plan.tp, requested, server_pid)
    return tuple(sorted((k, "dsv4-cluster" if proven else "unproven") for k in requested))
