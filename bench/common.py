"""What every benchmark shares: where results go and how they are written (JSON + a markdown table), percentiles,
the versions and machine of a run, a process that must answer `/health`, and what /proc says of a process."""

from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from dsv4_cluster.orchestrator.load.loadgen import percentile
from dsv4_cluster.orchestrator.processes import death_signal_preexec

RESULTS = Path(__file__).resolve().parent / "results"


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (an argument's value)."""
    return [int(x) for x in text.split(",") if x.strip()]


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of unsorted `values`; NaN when empty."""
    return percentile(sorted(values), p)


def cell(v: object, fmt: str = "") -> str:
    """A table cell: '-' for None, floats by `fmt` (default 3 significant digits, whole above 1000)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, fmt) if fmt else (f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}")
    return format(v, fmt) if fmt else str(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines; cells already strings are kept, others go through `cell`."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(c if isinstance(c, str) else cell(c) for c in r) + " |" for r in rows)]


def md_columns(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    """A markdown table of `rows` by (header, key, format) columns; a missing value is '-'."""
    return md_table([h for h, _, _ in columns], [[cell(r.get(k), f) for _, k, f in columns] for r in rows])


def write(out: Path, payload: object, md: str | None) -> Path:
    """OUT.json (the payload) and OUT.md (the table, unless None); returns OUT.json's path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    if md is not None:
        out.with_suffix(".md").write_text(md if md.endswith("\n") else md + "\n")
    return out.with_suffix(".json")


def versions() -> dict:
    """torch, Triton and the GPU of this run: every GPU results file records them."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(torch=torch.__version__, triton=triton_version, gpu=gpu)


def machine() -> dict:
    """CPUs and load average now: the machine may be shared, so every CPU benchmark records them."""
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def wait_http(url: str, timeout_s: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Until `url` answers 200; raises when a process of `procs` exits first or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")


STOP_S = 10.0  # SIGTERM to SIGKILL for a process `process` started


@contextmanager
def process(argv: list[str], health_url: str | None, log: Path, timeout_s: float = 30.0,
            env: dict | None = None, stop_s: float = STOP_S) -> Iterator[subprocess.Popen]:
    """`argv` in its own session, its output in `log`, until `health_url` answers (when given); stopped on exit
    (SIGTERM, SIGKILL after `stop_s`), and killed by the kernel if this thread dies first (a benchmark cut by its
    timeout leaves nothing running)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                preexec_fn=death_signal_preexec(os.getpid()))
    try:
        if health_url:
            wait_http(health_url, timeout_s, [proc])
        yield proc
    finally:          # reaped either way
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int, session: bool = False) -> float:
    """User + system CPU seconds of `pid` (all threads), or with `session` of every live process in its session."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in (os.listdir("/proc") if session else [str(pid)]):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if not session or int(fields[3]) == pid:   # field 6 of stat: the session id
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
