"""What the SGLang contract tests share: the version guard (never a skip in CI), the child processes, argv.

SGLang 0.5.23 is installed by `.ci/install`; on a developer machine without it the modules skip, in CI
(`CI=true`) they fail at import so the contract is never silently not checked.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, SGLANG_VERSION

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


class Forked:
    """A child of a zygote (`tests/sglang_zygote.py`), waited for as a Popen is: its exit status is a file."""

    def __init__(self, pid: int, out: str) -> None:
        self.pid, self._rc = pid, Path(out + ".rc")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._rc.exists():
            self.returncode = int(self._rc.read_text())
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"sglang child {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait(30)


@dataclass(frozen=True)
class Child:
    proc: Forked
    out: Path
    err: Path

    def kill(self) -> None:
        self.proc.kill()


CALL_TIME_ENV = frozenset({KERNELS_ENV, ATTEST_DIR_ENV})  # read by load_plugins() and our factory, not at import
_ZYGOTES: dict[frozenset, subprocess.Popen] = {}


def _zygote(env: dict[str, str]) -> subprocess.Popen:
    """This test process's zygote for `env` (started on first use; it ends when this process does)."""
    key = frozenset((k, v) for k, v in env.items() if k not in CALL_TIME_ENV)
    zygote = _ZYGOTES.get(key)
    if zygote is None or zygote.poll() is not None:
        zygote = subprocess.Popen([sys.executable, "-m", "tests.sglang_zygote"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        ready = zygote.stdout.readline()
        assert ready == "READY\n", f"the SGLang zygote did not start ({zygote.wait()}): {ready!r}"
        _ZYGOTES[key] = zygote
    return zygote


def start_child(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> Child:
    """Start `python -m tests.sglang_child ARGS` (or `python -c CODE ARGS`) as a fork of a zygote that imported
    SGLang once (`tests/sglang_zygote.py`), its output into files; `child_result` reads it. Children started
    together run side by side."""
    full_env = {**os.environ, **(env or {})}
    zygote = _zygote(full_env)
    folder = Path(tempfile.mkdtemp(prefix="sglang-child-"))
    out, err = folder / "out", folder / "err"
    argv = ["-c", code, *args] if code is not None else ["-m", "tests.sglang_child", *args]
    zygote.stdin.write(json.dumps({"argv": argv, "env": full_env, "out": str(out), "err": str(err)}) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    assert answer.startswith("PID "), f"the SGLang zygote did not fork: {answer!r}"
    return Child(Forked(int(answer.split()[1]), str(out)), out, err)


def child_result(c: Child, timeout_s: float = 240) -> Any:
    """A started child's RESULT line, parsed, once it has exited (an AssertionError with its stderr if it failed)."""
    try:
        c.proc.wait(timeout_s)
    finally:
        c.kill()
    stdout, stderr = (path.read_text(errors="replace") for path in (c.out, c.err))
    shutil.rmtree(c.out.parent, ignore_errors=True)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert c.proc.returncode == 0 and lines, f"child failed ({c.proc.returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def server_argv(plan: Any) -> list[str]:
    """The plan's argv after `-m sglang.launch_server`, weights replaced by the committed config; on a
    GPU host SGLang detects `--device cuda`, here it is said."""
    argv = list(plan.argv[plan.argv.index("sglang.launch_server") + 1:])
    argv[argv.index("--model-path") + 1] = str(CONFIG_DIR)
    return argv + ["--device", "cuda"]
