"""What the SGLang contract tests share: the version guard (never a skip in CI), the child processes, argv.

SGLang 0.5.23 is installed by `.ci/install`; on a developer machine without it the modules skip, in CI
(`CI=true`) they fail at import so the contract is never silently not checked.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import pytest

from dsv4_cluster.kernels.sglang_plugin.settings import ATTEST_DIR_ENV, KERNELS_ENV, SGLANG_VERSION
from tests.zygote import Started, start

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


CALL_TIME_ENV = frozenset({KERNELS_ENV, ATTEST_DIR_ENV})  # read by load_plugins() and our factory, not at import
# what every SGLang child imports first: the torchvision stand-in (sglang_child.py says why), then SGLang's package
PRELOAD = ("bench.sglang_stand_ins:install_torchvision_stand_in", "sglang", "sglang.srt.server_args")


def start_child(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> Started:
    """Start `python -m tests.sglang_child ARGS` (or `python -c CODE ARGS`) as a fork of a zygote that imported
    SGLang once (tests/zygote.py); `child_result` reads it. Children started together run side by side."""
    argv = ["-c", code, *args] if code is not None else ["-m", "tests.sglang_child", *args]
    return start(argv, PRELOAD, {**os.environ, **(env or {})}, CALL_TIME_ENV)


def child_result(c: Started, timeout_s: float = 240) -> Any:
    """A started child's RESULT line, parsed, once it has exited (an AssertionError with its stderr if it failed)."""
    code, stdout, stderr = c.result(timeout_s)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert code == 0 and lines, f"child failed ({code}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def server_argv(plan: Any) -> list[str]:
    """The plan's argv after `-m sglang.launch_server`, weights replaced by the committed config; on a
    GPU host SGLang detects `--device cuda`, here it is said."""
    argv = list(plan.argv[plan.argv.index("sglang.launch_server") + 1:])
    argv[argv.index("--model-path") + 1] = str(CONFIG_DIR)
    return argv + ["--device", "cuda"]
