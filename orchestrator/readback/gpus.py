"""Which GPUs a process actually holds, from the NVIDIA driver (`nvidia-smi --query-compute-apps`): with every GPU
visible to every worker the environment no longer says. None without a driver: the caller shows "unknown".
"""

from __future__ import annotations

import functools
import shutil
import subprocess

SMI_TIMEOUT_S = 10.0


def parse_gpus(text: str) -> dict[str, int]:
    """`index, uuid` lines -> {uuid: index}."""
    out = {}
    for line in text.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index.isdigit() and uuid:
            out[uuid] = int(index)
    return out


def parse_apps(text: str) -> list[tuple[int, str]]:
    """`pid, gpu_uuid` lines -> [(pid, uuid)]."""
    out = []
    for line in text.splitlines():
        pid, _, uuid = (part.strip() for part in line.partition(","))
        if pid.isdigit() and uuid:
            out.append((int(pid), uuid))
    return out


def gpus_held(pids: set[int], gpus_csv: str, apps_csv: str) -> list[int]:
    """Indices of the GPUs on which any of `pids` has a CUDA context, from nvidia-smi's two CSV answers."""
    return _held(pids, parse_gpus(gpus_csv), apps_csv)


def _held(pids: set[int], index: dict[str, int], apps_csv: str) -> list[int]:
    return sorted({index[uuid] for pid, uuid in parse_apps(apps_csv) if pid in pids and uuid in index})


def _smi(smi: str, query: str) -> str:
    return subprocess.run([smi, query, "--format=csv,noheader"], capture_output=True, text=True, check=True,
                          timeout=SMI_TIMEOUT_S).stdout


def read_gpus_held(pids: set[int]) -> list[int] | None:
    """The GPUs `pids` hold now, or None where the driver cannot be asked."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return _held(pids, _gpu_index(smi), _smi(smi, "--query-compute-apps=pid,gpu_uuid"))
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=4)
def _gpu_index(smi: str) -> dict[str, int]:
    """{uuid: index} of this machine's GPUs: asked once per process (a `status` asks per worker; the GPUs stay)."""
    index = parse_gpus(_smi(smi, "--query-gpu=index,uuid"))
    if not index:            # not cached: a driver that lists no GPU now may list them next time
        raise subprocess.SubprocessError("nvidia-smi listed no GPU")
    return index
