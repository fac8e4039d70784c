"""Run a benchmark in a private network namespace whose loopback ACKs at once (no delayed ACK).

SGLang's Rust router (sglang-router 0.3.2) does not set TCP_NODELAY on the connections it accepts and writes a
stream's head and body apart: Nagle holds the body until the head is ACKed, and the load generator's kernel, in
delayed-ACK mode on a keep-alive connection, ACKs 40 ms later (a flat ~44 ms p50 at every concurrency). A loopback
route with `quickack 1` inside `unshare -n` removes the stall for every router alike and touches nothing outside the
benchmark. Needs CAP_SYS_ADMIN (root in a container); without it `reexec_in_quickack_netns` says how to run on the
plain loopback instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ENV_FLAG = "DSV4_BENCH_QUICKACK_NETNS"
SETUP = ("set -e; ip link set lo up; "
         "ip route change local 127.0.0.0/8 dev lo proto kernel scope host src 127.0.0.1 table local quickack 1; "
         "ip route change local 127.0.0.1 dev lo proto kernel scope host src 127.0.0.1 table local quickack 1; "
         'exec "$@"')


def inside() -> bool:
    """True in the process `reexec_in_quickack_netns` started."""
    return os.environ.get(ENV_FLAG) == "1"


def reexec_in_quickack_netns(module: str, argv: list[str]) -> int:
    """Run `python -m module argv` inside a fresh network namespace with quickack loopback; its exit status."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"{missing} not found: install util-linux and iproute2, or pass --plain-loopback "
                           "(then the Rust router reads ~40 ms per request from delayed ACKs)")
    probe = subprocess.run(["unshare", "-n", "sh", "-c", SETUP, "sh", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"cannot make a network namespace with quickack loopback ({probe.stderr.strip()}); run "
                           "as root (CAP_SYS_ADMIN), or pass --plain-loopback (then the Rust router reads ~40 ms per "
                           "request from delayed ACKs)")
    env = {**os.environ, ENV_FLAG: "1"}
    cmd = ["unshare", "-n", "sh", "-c", SETUP, "sh", sys.executable, "-m", module, *argv]
    return subprocess.run(cmd, env=env).returncode
