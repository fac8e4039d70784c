"""Proof that the requested kernels ran in an embedded decode during verification: around the PD check's request,
the decode's device-side call counters (`/server_info.kernel_calls`) must rise for every requested kernel, in the
implementation its device runs (ours on CUDA, the reference op on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from dsv4_cluster.orchestrator.launch.plan import LaunchPlan

REFERENCE = "reference"


@dataclass(frozen=True)
class Calls:
    """One decode worker's counters: {kernel: {impl: calls}} and its device ("cpu", "cuda", ...)."""

    device: str
    counts: dict[str, dict[str, int]]

    def total(self, kernel: str, kernels_only: bool = False) -> int:
        return sum(n for impl, n in self.counts.get(kernel, {}).items() if not (kernels_only and impl == REFERENCE))


def read_server_info(client: httpx.Client, plan: LaunchPlan) -> dict[str, Any] | str:
    """The worker's /server_info, or why it cannot be read (the plan must have a server_info_url)."""
    try:
        r = client.get(plan.server_info_url)
        r.raise_for_status()
        return r.json()
    except (httpx.HTTPError, ValueError) as e:
        return f"{plan.name}: cannot read {plan.server_info_url}: {e}"


def read_calls(client: httpx.Client, plan: LaunchPlan) -> Calls | str:
    """The worker's counters, or why they cannot be read."""
    if plan.server_info_url is None:
        return f"{plan.name}: no /server_info to read kernel calls from"
    info = read_server_info(client, plan)
    if isinstance(info, str):
        return info
    counts = info.get("kernel_calls")
    if not isinstance(counts, dict):
        return f"{plan.name}: /server_info has no kernel_calls; the engine cannot say what ran"
    return Calls(str(info.get("device", "cpu")), {str(k): {str(i): int(n) for i, n in v.items()}
                                                  for k, v in counts.items() if isinstance(v, dict)})


def snapshot(plans: list[LaunchPlan]) -> dict[str, Calls | str]:
    with httpx.Client(timeout=10.0) as client:
        return {p.name: read_calls(client, p) for p in plans}


def call_problems(requested: tuple[str, ...], before: dict[str, Calls | str],
                  after: dict[str, Calls | str]) -> tuple[list[str], list[str]]:
    """(problems, notes) of the counters between two snapshots of the embedded decode workers."""
    problems = [v for v in (*before.values(), *after.values()) if isinstance(v, str)]
    served = [name for name, a in after.items()
              if isinstance(a, Calls) and isinstance(b := before.get(name), Calls)
              and any(a.total(k) > b.total(k) for k in a.counts)]
    if not served and not problems:
        problems.append("no decode worker's kernel counters rose during the PD check's decode steps")
    notes = []
    for name in served:
        a, b = after[name], before[name]
        assert isinstance(a, Calls) and isinstance(b, Calls)
        on_gpu = not a.device.startswith("cpu")
        for k in requested:
            old, new = b.total(k, kernels_only=on_gpu), a.total(k, kernels_only=on_gpu)
            if new <= old:
                ran = {impl: n - b.counts.get(k, {}).get(impl, 0) for impl, n in a.counts.get(k, {}).items()}
                problems.append(f"{name}: kernel {k} was not called during the PD check's decode steps "
                                f"(calls {old} -> {new}; what ran: {ran or 'nothing'})")
        if all(a.total(k, on_gpu) > b.total(k, on_gpu) for k in requested):
            how = "our kernels" if on_gpu else "the reference ops (CPU: no kernels)"
            notes.append(f"{name} ran {', '.join(requested)} as {how} during the PD check")
    return problems, notes
