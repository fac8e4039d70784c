"""Verification of a running cluster (`up`'s last step; `dsv4-cluster verify`):
1. Kernels active: `/server_info.kernels` (embedded) or every TP rank's attestation (SGLang).
2. Answers: the PD check (embedded) or the answer set through the router (SGLang).
3. Kernels called: device counters rise around step 2 on every decode rank.
4. Speed: a short throughput probe against the last good run (a warning on a large drop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dsv4_cluster.core import Role
from dsv4_cluster.kernels.sglang_plugin.attestation import COUNTER_PERIOD_S
from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV
from dsv4_cluster.orchestrator.verify import embedded_calls
from dsv4_cluster.orchestrator.launch.gpu_classes import detect_classes
from dsv4_cluster.orchestrator.verify.kernels import attestation_problems, counter_problems, read_counts
from dsv4_cluster.orchestrator.verify.pd_check import PDCheckError, check_pd_equivalence, router_url
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan, cluster_plans, requested_kernels
from dsv4_cluster.orchestrator.verify.serving import (
    check_answers, compare_with_last_good, probe_throughput, store_last_good)

CUDA_GRAPH_METRIC = "sglang:cuda_graph_passes_total"


def kernel_problems(name: str, requested: tuple[str, ...], info: dict[str, Any]) -> list[str]:
    """Why `info` (a worker's /server_info) shows a requested kernel inactive; empty when fine."""
    active = info.get("kernels")
    if not isinstance(active, dict):
        return [f"{name}: /server_info reports no kernels, but {', '.join(requested)} were "
                "requested; the engine cannot say whether they run"]
    return [f"{name}: kernel {k} was requested but is {active.get(k, 'missing')!r} in the worker"
            for k in requested if active.get(k) in (None, "off")]


def _attested(plan: LaunchPlan) -> str | None:
    """The attestation folder of a worker whose kernels are proven by its ranks (SGLang), else None."""
    env = plan.env_dict
    return env.get(ATTEST_DIR_ENV) if env.get(KERNELS_ENV) else None


def verify_kernels(plans: tuple[LaunchPlan, ...], requested: tuple[str, ...],
                   pids: dict[str, int | None] | None = None) -> list[str]:
    """Every worker's kernels: attestations (SGLang) or /server_info (embedded); one line per problem."""
    if not requested:
        return []
    problems = []
    classes = detect_classes() if any(_attested(p) for p in plans) else None   # this host's GPUs (one host)
    with httpx.Client(timeout=10.0) as client:
        for plan in plans:
            folder = _attested(plan)
            if folder is not None:
                gpu = {classes.get(g) for g in plan.gpus} if classes and plan.gpus else set()
                problems += attestation_problems(plan.name, folder, plan.tp, requested, (pids or {}).get(plan.name),
                                                 gpu.pop() if len(gpu) == 1 else None)
                continue
            if plan.server_info_url is None:
                continue
            info = embedded_calls.read_server_info(client, plan)
            problems += [info] if isinstance(info, str) else kernel_problems(plan.name, requested, info)
    return problems


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = "verified" if self.ok else f"NOT verified ({len(self.problems)} problem(s) below)"
        lines = [head + (": " + "; ".join(self.notes) if self.notes else "")]   # never a bare "NOT verified: "
        lines += [f"problem: {p}" for p in self.problems] + [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _graph_passes(plan: LaunchPlan) -> float | None:
    if plan.metrics_url is None:
        return None
    try:
        text = httpx.get(plan.metrics_url, timeout=10.0).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(CUDA_GRAPH_METRIC)]
    return sum(values) if values else None


def verify_cluster(topology: Any, pids: dict[str, int | None]) -> VerifyReport:
    """Steps 1-4 against the running cluster of `topology`; `pids`: each worker's supervised server pid."""
    report = VerifyReport()
    workers, _ = cluster_plans(topology)
    requested = requested_kernels(topology)
    report.problems += verify_kernels(tuple(workers), requested, pids)
    counted = [p for p in workers if p.role is Role.DECODE and _attested(p) and requested]
    before = {p.name: read_counts(_attested(p), p.tp) for p in counted}
    embedded = [p for p in workers if p.role is Role.DECODE and not _attested(p) and requested
                and str(topology.engine) == "embedded"]
    calls_before = embedded_calls.snapshot(embedded)
    base = router_url(topology) + "/v1"
    if str(topology.engine) == "sglang":
        answers = check_answers(base, topology.model.name)
        report.notes.append(answers.summary().splitlines()[0])
        if not answers.ok:
            report.problems.append(answers.summary())
    else:
        try:
            report.notes.append(check_pd_equivalence(topology).summary())
        except PDCheckError as e:
            report.problems.append(str(e))
        else:
            if embedded:
                problems, notes = embedded_calls.call_problems(requested, calls_before,
                                                               embedded_calls.snapshot(embedded))
                report.problems += problems
                report.notes += notes
    if counted:
        time.sleep(2 * COUNTER_PERIOD_S)  # let every rank publish the counts of the steps just taken
        rising = [problem for p in counted for problem in counter_problems(
            p.name, p.tp, requested, before[p.name], read_counts(_attested(p), p.tp))]
        report.problems += rising
        if not rising:
            report.notes.append(f"kernel counters rose on every rank of {', '.join(p.name for p in counted)}")
    try:
        tokens_per_s = probe_throughput(base, topology.model.name)
    except httpx.HTTPError as e:
        report.problems.append(f"throughput probe failed: {e}")
        return report
    report.notes.append(f"throughput {tokens_per_s:.1f} tok/s")
    drop = compare_with_last_good(topology.run_dir_path, tokens_per_s)
    if drop:
        report.warnings.append(drop)
    if str(topology.engine) == "sglang":
        for p in (w for w in workers if w.role is Role.DECODE):
            if not _graph_passes(p):
                report.warnings.append(f"{p.name}: {CUDA_GRAPH_METRIC} is 0 or missing: decode may run eager")
    if report.ok and not drop:
        store_last_good(topology.run_dir_path, tokens_per_s)
    return report
