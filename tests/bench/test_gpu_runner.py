"""bench/gpu.sh, the one GPU runner (its GPU work runs only on a GPU machine): every suite it accepts is documented
in its header with its command line and run by one branch of its case statement, and a name it does not know is
refused by name with exit status 2."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.sh"


def _parts() -> tuple[set[str], set[str], set[str]]:
    text = SCRIPT.read_text()
    accepted = set(re.search(r'^suites="([^"]+)"', text, re.M)[1].split())
    header = text.split("\nset -uo pipefail", 1)[0]
    documented = set(re.findall(r"^# ([a-z0-9_]+) {2,}\S", header, re.M))
    branches = {name for arm in re.findall(r"^([a-z0-9_|]+)\)$", text, re.M) for name in arm.split("|")}
    return accepted, documented, branches


def test_every_accepted_suite_is_documented_and_has_a_branch():
    accepted, documented, branches = _parts()
    assert accepted == documented == branches, (accepted, documented, branches)
    assert {"sparse_decode", "indexer", "sglang_decode", "sglang_backend", "sm120", "gpu_suite", "engine",
            "kv_transfer", "ncu"} <= accepted


def test_an_unknown_suite_is_refused_by_name(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "no_such_suite"], capture_output=True, text=True, timeout=30,
                          cwd=SCRIPT.parents[1], env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 2 and "unknown suite no_such_suite" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
