"""Spawning a planned process: its files written (0600: the router's settings hold the admin token),
its own process group and session, PR_SET_PDEATHSIG tied to the calling thread, output to its log."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dsv4_cluster.orchestrator.launch.plan import LaunchPlan
from dsv4_cluster.orchestrator.processes import death_signal_preexec, start_logged


def spawn(plan: LaunchPlan) -> tuple[subprocess.Popen[bytes], int]:
    """Start `plan`'s process; returns it and the byte offset in its (appended) log where this start's lines begin.
    The death signal follows the thread that forks: call this from the thread that will outlive the process (the
    supervisor's process thread)."""
    Path(plan.cwd).mkdir(parents=True, exist_ok=True)
    for path, text in plan.files:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the router's settings
        os.fchmod(fd, 0o600)                                                # hold the admin token
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return start_logged(plan.argv, plan.log_path, "supervisor", cwd=plan.cwd, env={**os.environ, **plan.env_dict},
                        preexec_fn=death_signal_preexec(os.getpid()))
