"""A sampled profile of our router under the router benchmark's load (`python -m bench.router --profile`).

py-spy samples the router process (it must be on PATH: `pip install py-spy`) while wrk drives it at the highest
concurrency; the folded stacks are reduced to two tables, self and inclusive share of the samples per function
(file:line), written beside the benchmark's numbers as `router_profile.txt`. Time inside a system call (a socket
write, a read) is charged to the Python line that made it.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
from pathlib import Path

OURS = ("router/", "uvicorn/", "starlette/", "prometheus_client/", "pydantic/")


def start(pid: int, seconds: float, raw: Path) -> subprocess.Popen | None:
    """py-spy recording `pid` for `seconds` into `raw` (folded stacks); None when py-spy is not installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    return subprocess.Popen([spy, "record", "--rate", "250", "--duration", f"{seconds:g}", "--format", "raw",
                             "--output", str(raw), "--pid", str(pid)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _frame(name: str) -> str:
    """'func (path/to/file.py:12)' -> 'func file.py:12' with the path cut to its last two parts."""
    func, _, where = name.partition(" (")
    return f"{func} {'/'.join(where.rstrip(')').split('/')[-2:])}" if where else func


def tables(raw_text: str, top: int = 30) -> str:
    """Self and inclusive sample shares from py-spy's folded stacks ('frame;frame;... count' per line)."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in raw_text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    if not total:
        return "no samples\n"
    out = [f"{total} samples", "", "self (where the time is spent):"]
    out += [f"{100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    out += ["", "inclusive (the router's own frames and its server's):"]
    mine = [(f, n) for f, n in inclusive.most_common() if any(k in f for k in OURS) and n < total]
    out += [f"{100 * n / total:5.1f}%  {f}" for f, n in mine[:top]]
    return "\n".join(out) + "\n"
