"""Which process holds a TCP port on this machine, so preflight can name it: sockets from /proc/net/tcp{,6} matched
to processes' fds. Processes this user may not inspect are skipped: the answer may be incomplete, never a guess.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

CMDLINE_CHARS = 120


def tcp_sockets() -> Iterator[tuple[list[str], bool]]:
    """Each row of /proc/net/tcp and tcp6 split into its columns (1: local address, 3: state, 9: inode), with
    whether it is the IPv6 table; a table that cannot be read (absent: no IPv6) is skipped."""
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield line.split(), v6


def _socket_inodes(port: int) -> set[str]:
    return {cols[9] for cols, _ in tcp_sockets() if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[9] != "0"}


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"pid {pid} ({cmd[:CMDLINE_CHARS]}{'...' if len(cmd) > CMDLINE_CHARS else ''})"


def socket_owners(inodes: set[str]) -> dict[str, int]:
    """inode -> pid of the process holding that socket, for the `inodes` (strings, as /proc/net/tcp writes
    them) some readable process holds."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    owners: dict[str, int] = {}
    if not wanted:
        return owners
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                inode = wanted.get(str(fd.readlink()))
            except OSError:
                continue
            if inode is not None:
                owners.setdefault(inode, int(proc.name))
    return owners


def port_holders(port: int) -> list[str]:
    """'pid N (command line)' of every process with a socket on local TCP port `port`."""
    pids = sorted(set(socket_owners(_socket_inodes(port)).values()))
    return [_describe(pid) for pid in pids]


def held_ports_note(ports: tuple[int, ...]) -> str:
    """For a process that exited before it was ready: '; port N is in use by pid M (...)' for each of its ports
    another process holds now (the likely cause: it could not bind), else ''."""
    notes = [f"port {port} is in use by {', '.join(holders)} — stop it or pick another port in the topology"
             for port in ports for holders in [port_holders(port)] if holders]
    return "".join(f"; {note}" for note in notes)
