"""Per-rank proof that the kernels are installed and running, as files under the worker's run folder.

`rank{R}.json` is written by each TP process once its backend holds the adapters (identity-checked):
rank, pid, GPU, its class (sm_90 / sm_100 / sm_120), SGLang and project versions, per kernel the call sites
that hold our function and whether the kernel is ours or stock.
`counters-rank{R}.json` is rewritten every `COUNTER_PERIOD_S` by a daemon thread with the device
counters (copied on a side stream, so it never waits for the model's work). `dsv4-cluster verify`
reads both (orchestrator/verify/kernels.py); the formats are this module's, both sides import it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


COUNTER_PERIOD_S = 1.0
# the counter of decode calls the route table left on SGLang's stock kernel (kernels/decode_routes.py)
STOCK_DECODE = "sparse_mla_decode_stock"
# the counter of the decode-metadata builds ours made (call_sites: the sites with `metadata`)
METADATA = "sparse_mla_decode_metadata"


@dataclass(frozen=True)
class Attestation:
    worker: str | None
    rank: int
    pid: int
    gpu: int | None
    sglang_version: str
    project_version: str
    call_sites: dict[str, list[str]] = field(default_factory=dict)  # kernel -> sites holding our function
    gpu_class: str | None = None  # sm_90 / sm_100 / sm_120 (absent in attestations written before it was added)
    kernels: dict[str, str] = field(default_factory=dict)  # kernel -> "ours" | "stock"
    # sparse decode per call (layer kind / real heads): where ours runs, where stock does, and why (decode_routes)
    decode_routes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attestation:
        return cls(worker=data.get("worker"), rank=int(data["rank"]), pid=int(data["pid"]), gpu=data.get("gpu"),
                   sglang_version=str(data["sglang_version"]), project_version=str(data["project_version"]),
                   call_sites={k: list(v) for k, v in dict(data.get("call_sites") or {}).items()},
                   gpu_class=data.get("gpu_class"), kernels=dict(data.get("kernels") or {}),
                   decode_routes=dict(data.get("decode_routes") or {}))


def attestation_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


def counters_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"counters-rank{rank}.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # readers never see half a file


def write_attestation(folder: str | Path, attestation: Attestation) -> Path:
    path = attestation_path(folder, attestation.rank)
    _write_json(path, asdict(attestation))
    return path


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


CU_STREAM_CAPTURE_MODE_RELAXED = 2  # CUstreamCaptureMode (cuda.h)


def relax_capture_mode() -> bool:
    """Put the calling thread in CUDA's relaxed stream-capture mode (cuThreadExchangeStreamCaptureMode): its
    own calls stay legal, and harmless, while another thread captures a CUDA graph in global mode. False
    where the driver cannot be reached (no GPU)."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
    return driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0


class CounterPublisher:
    """Copies the device counters to a file every period, from a daemon thread it keeps."""

    def __init__(self, folder: str | Path, rank: int, counters: Any) -> None:
        self.path = counters_path(folder, rank)
        self.counters = counters
        self._stop = threading.Event()
        self._stream: Any = None
        self._host: Any = None
        self.relaxed: bool | None = None  # whether the thread runs in CUDA's relaxed capture mode (None: not started)
        self.last_error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"dsv4-counters-rank{rank}", daemon=True)

    def start(self) -> CounterPublisher:
        self.publish()
        self.thread.start()
        return self

    def snapshot(self) -> list[int]:
        import torch

        values = self.counters.values
        if values.device.type != "cuda":
            return [int(v) for v in values.tolist()]
        if self._stream is None:  # made once, by the first caller (start(): the thread that installed us)
            self._stream = torch.cuda.Stream(device=values.device)
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        with torch.cuda.stream(self._stream):
            self._host.copy_(values, non_blocking=True)
        self._stream.synchronize()
        return [int(v) for v in self._host.tolist()]

    def publish(self) -> None:
        counts = dict(zip(self.counters.NAMES, self.snapshot()))
        _write_json(self.path, {"pid": os.getpid(), "time": time.time(), "counts": counts})

    def _run(self) -> None:
        # SGLang captures its decode graphs in the default (global) capture mode, in which a copy from any other
        # thread of a thread in that mode invalidates the capture (seen on the H200: "operation not permitted
        # when stream is capturing" here, the capture of SGLang's backend failed). This thread only copies on
        # its own stream, which is safe beside a capture: it declares so (relaxed mode, per thread).
        self.relaxed = relax_capture_mode()
        while not self._stop.wait(COUNTER_PERIOD_S):
            try:
                self.publish()
            except Exception as e:  # a snapshot that fails once must not end the publishing for good
                self.last_error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop.set()
