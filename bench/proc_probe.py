"""What the cluster's processes hold, read from /proc: listening sockets and who owns them, orphans, RSS.

Used by the reliability bench and its tests (Linux only): the addresses workers bind, processes left behind
after a fault or `down`, and memory growth under load.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from dsv4_cluster.orchestrator.launch.port_owner import socket_owners, tcp_sockets

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int | None


def _hex_address(field: str, v6: bool) -> tuple[str, int]:
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    if v6:
        words = struct.unpack("<4I", raw)
        text = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
    else:
        text = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr, 16)))
    return text, int(port, 16)


def listeners(ports: set[int]) -> list[Listener]:
    """Every TCP socket listening on one of `ports`, with its bound address and owning pid."""
    found: list[tuple[str, int, str]] = []
    for cols, v6 in tcp_sockets():
        if cols[3] != LISTEN:
            continue
        address, port = _hex_address(cols[1], v6)
        if port in ports:
            found.append((address, port, cols[9]))
    owners = socket_owners({inode for _, _, inode in found})
    return [Listener(address, port, owners.get(inode)) for address, port, inode in found]


def ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def worker_processes(ports: set[int]) -> dict[int, list[int]]:
    """port -> pids of embedded worker processes started with `--port PORT` (alive, stopped or zombie)."""
    out: dict[int, list[int]] = {p: [] for p in ports}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        argv = cmdline(int(proc.name))
        if not any(a.startswith("dsv4_cluster.workers.") for a in argv) or "--port" not in argv:
            continue
        try:
            port = int(argv[argv.index("--port") + 1])
        except (IndexError, ValueError):
            continue
        if port in out:
            out[port].append(int(proc.name))
    return out


def orphans(ports: set[int], worker_ports: set[int]) -> list[str]:
    """What should not be there: two processes on one port, a process reparented to init (its supervisor
    gone), a worker process that is not the one listening (a stale copy). Empty when all is well."""
    problems = []
    by_port: dict[int, set[int]] = {}
    for lst in listeners(ports):
        if lst.pid is not None:
            by_port.setdefault(lst.port, set()).add(lst.pid)
    for port, pids in sorted(by_port.items()):
        if len(pids) > 1:
            problems.append(f"port {port}: {len(pids)} processes listen ({sorted(pids)})")
        for pid in pids:
            if ppid(pid) == 1:
                problems.append(f"port {port}: pid {pid} was reparented to init (its supervisor is gone)")
    for port, pids in worker_processes(worker_ports).items():
        stale = [p for p in pids if p not in by_port.get(port, set())]
        if stale:
            problems.append(f"port {port}: worker process(es) {stale} not listening (left behind)")
    return problems
