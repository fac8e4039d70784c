"""Liveness of processes and process groups (and stopping them), the death signal a supervisor gives its children,
the event SIGTERM/SIGINT set, a start whose output is appended to a log and that log's tail, and the one atomic file
write the records and targets use. A zombie counts as gone (it holds nothing, though `kill(pid, 0)` succeeds). Linux
only (/proc).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 30


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
    return text[text.rindex(")") + 2:].split()


def exit_text(code: int) -> str:
    """How a process ended, for an operator: 'exited with code 3', or 'was killed by SIGKILL' (Popen's negative
    return code is the signal)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to every process of group `pgid`; a group already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop_groups(pgids: list[int], deadline_s: float) -> list[int]:
    """SIGTERM every group, SIGKILL those left after `deadline_s`; returns the groups still not gone."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + deadline_s
    while any(group_members(p) for p in pgids) and time.monotonic() < end:
        time.sleep(0.1)
    for pgid in pgids:
        if group_members(pgid):
            signal_group(pgid, signal.SIGKILL)
    return [p for p in pgids if group_members(p)]


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event (`stop`, or a new one) SIGTERM or SIGINT sets (each replaces the handler Python or Ray installed)."""
    stop = stop if stop is not None else threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held while the block runs, delivered when it ends: a handler a library installs meanwhile
    (ray.init installs Ray's, which kills the process) never sees them if the block installs its own after it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None when it is gone.
    With the pid it names one process for good: a recycled pid starts later."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def death_signal_preexec(parent_pid: int) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets SIGKILL when the thread that forked it dies."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the supervisor died between fork and prctl
            os._exit(1)

    return preexec


def start_logged(argv: list[str] | tuple[str, ...], log_path: str | Path, starter: str,
                 **popen: Any) -> tuple[subprocess.Popen[bytes], int]:
    """Start `argv` in a session of its own, stdin closed, its output appended to `log_path` after a header line
    ("=== <time> <starter> starts: <argv>"); returns it and the header's byte offset, where this start's part of the
    log begins (its error tails read from there: `log_tail`'s `offset`). `popen`: Popen's other arguments."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {starter} starts: {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, **popen), offset


def log_tail(path: str, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    """The log's last `lines` lines from byte `offset` on (where this run's part of an appended log starts, a line's
    start); from the log's start when no line starts there now (truncated under its writer, as by logrotate's
    copytruncate, and maybe written past that offset again)."""
    try:
        with open(path, "rb") as f:
            if offset > os.fstat(f.fileno()).st_size or offset and (f.seek(offset - 1), f.read(1))[1] != b"\n":
                offset = 0
            f.seek(offset)
            return b"".join(deque(f, maxlen=lines)).decode(errors="replace")
    except FileNotFoundError:
        return "(no log file)"


def with_log_tail(reason: str, path: str, offset: int = 0) -> str:
    """`reason`, then the log's last lines on the lines below it (a reason's first line, all the status history and
    the router keep, is `reason` alone); "(the log is empty)" after it when there are none."""
    tail = log_tail(path, offset=offset)
    return f"{reason}\nlast log lines:\n{tail}" if tail.strip() else f"{reason} (the log is empty)"


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` with `text` in one rename: a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")   # created 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
