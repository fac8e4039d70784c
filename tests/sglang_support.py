"""What the SGLang contract tests share: the version guard (never a skip in CI), the child processes, argv.

SGLang 0.5.23 is installed by `.ci/install`; on a developer machine without it the modules skip, in CI
(`CI=true`) they fail at import so the contract is never silently not checked.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from dsv4_cluster.kernels.sglang_plugin.settings import SGLANG_VERSION

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "tests" / "data" / "deepseek-v4-flash"


def require_sglang() -> None:
    """Skip the calling module without the pinned SGLang; raise instead when CI=true."""
    try:
        found: str | None = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == SGLANG_VERSION:
        return
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"CI must run the SGLang contract tests: sglang {found} is installed, "
                           f"not {SGLANG_VERSION}; .ci/install installs it")
    pytest.skip(f"sglang=={SGLANG_VERSION} is not installed (bash .ci/install)", allow_module_level=True)


@dataclass(frozen=True)
class Child:
    proc: subprocess.Popen
    out: IO[bytes]
    err: IO[bytes]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_child(*args: str, env: dict[str, str] | None = None) -> Child:
    """Start `tests/sglang_child.py` in a fresh interpreter (its output into files: children started together
    never wait on a full pipe); `child_result` reads it. Each imports SGLang, seconds of one core: a module
    whose children are independent starts them together."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_child", *args], stdout=out, stderr=err,
                            env={**os.environ, **(env or {})}, cwd=REPO)
    return Child(proc, out, err)


def child_result(c: Child) -> Any:
    """A started child's RESULT line, parsed, once it has exited (an AssertionError with its stderr if it failed)."""
    try:
        c.proc.wait(240)
    finally:
        c.kill()
    stdout, stderr = (f.seek(0) or f.read().decode(errors="replace") for f in (c.out, c.err))
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert c.proc.returncode == 0 and lines, f"child failed ({c.proc.returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def server_argv(plan: Any) -> list[str]:
    """The plan's argv after `-m sglang.launch_server`, weights replaced by the committed config; on a
    GPU host SGLang detects `--device cuda`, here it is said."""
    argv = list(plan.argv[plan.argv.index("sglang.launch_server") + 1:])
    argv[argv.index("--model-path") + 1] = str(CONFIG_DIR)
    return argv + ["--device", "cuda"]
