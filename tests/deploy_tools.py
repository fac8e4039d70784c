"""Test helper: the Debian tools the deploy tests run (systemd-analyze, promtool, prometheus).

`deploy/install-test-deps.sh` installs them. On CI (CI=true) a missing tool fails the test, so a
CI machine without them cannot pass by skipping; on a developer machine the test skips and says
how to install it.
"""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL_HINT = "run deploy/install-test-deps.sh as root"


def require_tool(name: str) -> str:
    """The tool's path; fails on CI, skips elsewhere, when it is not on PATH."""
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed; {INSTALL_HINT}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " (CI=true: the deploy tests may not skip)")
    pytest.skip(message)
