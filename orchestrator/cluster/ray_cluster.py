"""The Ray cluster under the orchestrator: start a local head that outlives the CLI, or join one.

A `ray.init()` in the CLI would start a cluster that dies with it, so `up` runs `ray start --head --block` as its
own process group (loopback, every port free below the ephemeral range) and `down` signals that group. Never
`ray stop`: it kills every Ray process on the machine.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from dsv4_cluster.orchestrator.errors import RayClusterError
from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.orchestrator.processes import group_members, signal_group, with_log_tail
from dsv4_cluster.orchestrator.cluster.ray_env import RAY_ENV
from dsv4_cluster.orchestrator.cluster.record import HeadProcess

HEAD_HOST = "127.0.0.1"
READY_LINE = "Ray runtime started"
POLL_S = 0.2
CONNECT_TIMEOUT_S = 5.0
HEAD_GRACE_S = 1.0  # how long a stopping head's processes get after SIGTERM before SIGKILL (`stop_head`)


# `ray start` with Ray's client server off: Ray starts one (port 10001 by default) whenever its client dependencies
# are installed, and refuses `--ray-client-server-port 0`. Nothing here connects through it (drivers and joining
# nodes use the GCS address); it would be one more process per head and one more port that runs any code sent to it.
_RAY_START = ("import sys; from ray.scripts import scripts; "
              "scripts.get_ray_client_dependency_error = lambda: 'not used by dsv4-cluster'; "
              "sys.argv[0] = 'ray'; sys.exit(scripts.main())")


def _ray_command() -> list[str]:
    """`ray` run by this Python: Ray starts its workers (our actors) with the head's interpreter, so a `ray` found
    on PATH for another Python (a virtualenv over system site-packages) would run the actors on another copy of
    this package (seen: a test's cluster ran the actors, the workers and the router from another checkout)."""
    return [sys.executable, "-c", _RAY_START]


def start_head(log_path: Path, num_cpus: int | None, timeout_s: float,
               reserved: frozenset[int] = frozenset()) -> tuple[str, HeadProcess]:
    """Start a Ray head in its own process group; returns its address once it accepts drivers. `reserved`: ports
    the head must not take though they are free now (the topology's workers and router bind them later: seen in CI,
    a head's port on the router's, which then crash-looped on the bind)."""
    gcs, agent, agent_grpc, metrics, env_agent = free_ports(5, exclude=reserved)
    argv = [
        *_ray_command(), "start", "--head", "--block",
        "--node-ip-address", HEAD_HOST, "--port", str(gcs),
        "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
        "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(env_agent),
        "--include-dashboard=false", "--disable-usage-stats",
        "--include-log-monitor=false",  # it forwards actor output to drivers, and ours connect with log_to_driver=False
        # the autoscaler monitor stays (no --no-monitor): nothing here scales, but without it `ray status` answers
        # "No cluster status", and an operator's first look at a Ray cluster is that command
    ]
    if num_cpus is not None:
        argv += ["--num-cpus", str(num_cpus)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **RAY_ENV}, start_new_session=True)
    head = HeadProcess(pid=proc.pid, log_path=str(log_path))
    try:
        _wait_started(proc, log_path, offset, timeout_s)
    except BaseException:  # a timeout, or SIGTERM/SIGINT while waiting: no head left behind
        stop_head(head, deadline_s=5.0)
        raise
    return f"{HEAD_HOST}:{gcs}", head


def _wait_started(proc: subprocess.Popen[bytes], log_path: Path, offset: int,
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in _read_from(log_path, offset):
        if proc.poll() is not None:
            raise RayClusterError(with_log_tail(f"`ray start --head` exited with code {proc.returncode} "
                                                f"({log_path})", str(log_path), offset))
        if time.monotonic() > deadline:
            raise RayClusterError(with_log_tail(f"the Ray head did not start within {timeout_s:.0f}s ({log_path})",
                                                str(log_path), offset))
        time.sleep(POLL_S)


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def stop_head(head: HeadProcess, deadline_s: float) -> None:
    """SIGTERM the head's process group, SIGKILL what is left after HEAD_GRACE_S (at most `deadline_s`), then wait
    up to `deadline_s` for the group to be gone. The grace is short on purpose: the head holds no state worth a
    clean exit (its GCS keeps nothing on disk), and on SIGTERM its processes leave one after another (3.8 s on a
    2-core machine), a wait every `down` paid; `ray stop --force` kills them the same way."""
    signal_group(head.pid, signal.SIGTERM)
    for sig, wait_s in ((signal.SIGKILL, min(HEAD_GRACE_S, deadline_s)), (None, deadline_s)):
        deadline = time.monotonic() + wait_s
        while group_members(head.pid) and time.monotonic() < deadline:
            _reap(head.pid)
            time.sleep(POLL_S)
        _reap(head.pid)
        if sig is None or not group_members(head.pid):
            return
        signal_group(head.pid, sig)


def _reap(pid: int) -> None:
    """Collect the head's exit status when this process started it (no zombie lingers)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def connect(address: str, namespace: str) -> None:
    """Attach this process to the Ray cluster at `address` as a driver in `namespace`."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise RayClusterError(f"no Ray cluster answers at {address} ({e}); start one, or fix "
                              "--address / cluster.address") from e
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
    except (ConnectionError, RuntimeError) as e:
        raise RayClusterError(f"cannot reach the Ray cluster at {address}: {e}") from e


def disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()


def head_alive(head: HeadProcess) -> bool:
    return bool(group_members(head.pid))


def beyond_a_new_head(topology: Any, plans: list[Any]) -> list[str]:
    """One line per process that a Ray head `up` starts could never place: that head is the only node of its cluster
    (this machine at HEAD_HOST, which no other machine can join), and Ray places a process by its node's IP."""
    problems = []
    for plan in plans:
        address = topology.node(plan.node).address
        if ray_node_ip(address) != HEAD_HOST:
            problems.append(f"{plan.name}: node {plan.node!r} ({address}) is not this machine at {HEAD_HOST}, the only "
                            f"node of the Ray head `up` starts; start Ray on every node (`ray start --head` here, "
                            f"`ray start --address <head>` on {address}) and pass the head's address to `up --address` "
                            f"or cluster.address")
    return problems


def ray_node_ip(address: str) -> str:
    """The IP Ray knows a node at `address` by: the address itself when it is an IP (or does not resolve here:
    `up` then names the node as missing), else what the hostname resolves to."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address
