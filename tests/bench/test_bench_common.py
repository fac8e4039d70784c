"""bench/common.py: what every benchmark shares (no cluster: one interpreter that starts one child)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import gone, wait_for

REPO = Path(__file__).resolve().parents[2]   # `bench` imports from a checkout's root


def test_a_process_it_started_dies_with_the_benchmark_that_was_killed(tmp_path):
    """A benchmark cut by gpu.sh's timeout is SIGKILLed: what it started through `common.process` (workers, stubs,
    routers, the KV-transfer sides) must not outlive it (the kernel's parent-death signal, not a cleanup that a
    SIGKILL never runs)."""
    pid_file = tmp_path / "pid"
    bench = (f"import sys, time; from pathlib import Path; from bench.common import process\n"
             f"with process([sys.executable, '-c', 'import time; time.sleep(120)'], None, Path({str(tmp_path)!r}) / 'log')"
             f" as p:\n    Path({str(pid_file)!r}).write_text(str(p.pid))\n    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", bench], cwd=REPO)
    try:
        child = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the child's pid"))
    finally:
        parent.kill()
        parent.wait()
    assert gone([child], 10) == [], "the child outlived the benchmark that started it"
