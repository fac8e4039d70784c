"""Verification after the workers are READY: every requested kernel is active in every worker.

A kernel that was asked for and is not running is the classic silent failure (an env flag the
engine ignored), so `up` fails on it. Each worker reports its kernels in `/server_info` as
`kernels: {name: "reference" | "triton" | "off"}`.
"""

from __future__ import annotations

from typing import Any

import httpx

from dsv4_cluster.orchestrator.plan import LaunchPlan


def kernel_problems(name: str, requested: tuple[str, ...], info: dict[str, Any]) -> list[str]:
    """Why `info` (a worker's /server_info) shows a requested kernel inactive; empty when fine."""
    active = info.get("kernels")
    if not isinstance(active, dict):
        return [f"{name}: /server_info reports no kernels, but {', '.join(requested)} were "
                "requested; the engine cannot say whether they run"]
    return [f"{name}: kernel {k} was requested but is {active.get(k, 'missing')!r} in the worker"
            for k in requested if active.get(k) in (None, "off")]


def verify_kernels(plans: tuple[LaunchPlan, ...], requested: tuple[str, ...]) -> list[str]:
    """Ask every worker which kernels run; one line per requested kernel that does not."""
    if not requested:
        return []
    problems = []
    with httpx.Client(timeout=10.0) as client:
        for plan in plans:
            if plan.server_info_url is None:
                continue
            try:
                r = client.get(plan.server_info_url)
                r.raise_for_status()
                info = r.json()
            except (httpx.HTTPError, ValueError) as e:
                problems.append(f"{plan.name}: cannot read {plan.server_info_url}: {e}")
                continue
            problems += kernel_problems(plan.name, requested, info)
    return problems
