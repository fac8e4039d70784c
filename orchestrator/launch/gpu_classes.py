"""What runs where, by GPU class: the kernel dispatch table (kernels/dispatch.py) applied to a topology's GPUs.

The class comes from the driver (`nvidia-smi --query-gpu=index,compute_cap`) or, with no GPU here, from
`plan --gpu-class`. `plan` prints the rows; preflight refuses a requested kernel on a class with no row (fail
closed, as the plugin does); `verify` expects each SGLang rank's attestation to name its class and our kernels.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable

from dsv4_cluster.kernels import decode_routes, dispatch
from dsv4_cluster.kernels.sglang_plugin.call_sites import STOCK, sites_for

MODEL_HEADS = 64                 # DeepSeek-V4-Flash's query heads; a TP-t rank has 64 / t of them


class GpuClassError(RuntimeError):
    """The GPUs' classes could not be read (no driver, an unreadable answer)."""


def classes_from_smi(text: str) -> dict[int, str | None]:
    """`index, compute_cap` CSV lines -> {GPU index: class, or None for a capability with no class}."""
    out: dict[int, str | None] = {}
    for line in text.strip().splitlines():
        try:
            index, cap = (x.strip() for x in line.split(","))
            major, minor = (int(x) for x in cap.split("."))
            out[int(index)] = dispatch.CLASS_OF_MAJOR.get(major)
        except ValueError as e:
            raise GpuClassError(f"nvidia-smi answered {line!r}, not 'index, compute_cap'") from e
    return out


def detect_classes(run: Callable[..., Any] = subprocess.run) -> dict[int, str | None] | None:
    """This machine's GPUs by index -> class (None: a capability none of the classes has); None without a driver."""
    if shutil.which("nvidia-smi") is None and run is subprocess.run:
        return None
    try:
        done = run(["nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv,noheader"], capture_output=True,
                   text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return classes_from_smi(done.stdout)


@dataclass(frozen=True)
class KernelRow:
    worker: str
    gpu_class: str
    kernel: str
    runs: str        # what runs: "ours: gluon, 64 heads", "ours: triton", or "stock: why"
    where: str       # the call site(s) of that class


def gpu_workers(topology: Any) -> list[Any]:
    """Workers whose requested kernels run on a GPU: every SGLang worker, embedded workers on cuda."""
    return [w for w in topology.workers if topology.engine == "sglang" or str(w.device) == "cuda"]


def requested(topology: Any) -> tuple[str, ...]:
    return tuple(k for k, on in topology.kernels.model_dump().items() if on)


def worker_class(worker: Any, classes: dict[int, str | None]) -> str | None:
    """The one class of the worker's GPUs (None if any is unknown); GpuClassError if they differ."""
    found = {classes.get(g) for g in worker.gpus}
    if len(found) > 1:
        raise GpuClassError(f"{worker.name}: its GPUs {worker.gpus} are of different classes {sorted(map(str, found))}"
                            "; one server's TP ranks must share one class")
    return found.pop() if found else None


def kernel_rows(topology: Any, gpu_class: Callable[[Any], str]) -> list[KernelRow]:
    """For each GPU worker and requested kernel, what the dispatch table runs on its class `gpu_class(worker)`."""
    rows = []
    for w in gpu_workers(topology):
        gpu = gpu_class(w)
        for kernel in requested(topology):
            rows.append(KernelRow(w.name, gpu, kernel, _what_runs(topology, w, gpu, kernel), _where(topology, gpu,
                                                                                                     kernel)))
    return rows


def _what_runs(topology: Any, worker: Any, gpu: str, kernel: str) -> str:
    if kernel != "sparse_mla_decode":
        return f"ours: {dispatch.implementation(gpu, kernel)}"
    if topology.engine == "sglang":   # SGLang hands the adapter q padded to 64 heads, TP's real heads in front
        real = MODEL_HEADS // worker.tp
        return f"routed ({real} real heads at TP{worker.tp}): {decode_routes.summary(gpu, real)}"
    impl = dispatch.decode_impl(gpu, MODEL_HEADS)
    below = f" from B = {impl.min_batch} ({impl.fallback.backend} below)" if impl.min_batch > 1 and impl.fallback else ""
    return f"ours: {impl.backend}, {MODEL_HEADS} heads{below}"


def _where(topology: Any, gpu: str, kernel: str) -> str:
    if topology.engine != "sglang":
        return "embedded engine (workers/engine/kernel_ops.py)"
    sites = [f"{s.module.rsplit('.', 1)[-1]}.{s.attr}" for s in sites_for(gpu, kernel)]
    stock = [s.what for s in STOCK if s.kernel == kernel and gpu in s.classes]
    return ", ".join(sites) + (f"; not ours: {', '.join(stock)} (opt-in)" if stock else "")


def kernel_problems(topology: Any, classes: dict[int, str | None], workers: list[Any] | None = None) -> list[str]:
    """Requested kernels on GPUs the table has no class for, or workers whose GPUs differ in class (`workers`:
    those whose GPUs `classes` describes, by default every GPU worker)."""
    want = requested(topology)
    if not want:
        return []
    problems = []
    for w in gpu_workers(topology) if workers is None else workers:
        try:
            gpu = worker_class(w, classes)
        except GpuClassError as e:
            problems.append(str(e))
            continue
        unknown = [g for g in w.gpus if g in classes and classes[g] is None]
        if unknown or (gpu is None and w.gpus and all(g in classes for g in w.gpus)):
            problems.append(
                f"{w.name}: kernels {', '.join(want)} requested, but GPU(s) {unknown or w.gpus} are of a compute "
                f"capability none of the kernels' classes has ({', '.join(dispatch.GPU_CLASSES)}: "
                f"{'; '.join(dispatch.EXAMPLE_GPUS.values())}) — set `kernels:` to false to run SGLang's own, "
                "or move the worker to such GPUs")
    return problems


def rows_text(rows: list[KernelRow], source: str) -> str:
    """The table `plan` prints (source: where the classes came from)."""
    if not rows:
        return ""
    lines = [f"Kernels by GPU class ({source}; kernels/dispatch.py):",
             f"  {'WORKER':<12} {'CLASS':<7} {'KERNEL':<18} {'RUNS':<38} CALL SITE"]
    lines += [f"  {r.worker:<12} {r.gpu_class:<7} {r.kernel:<18} {r.runs:<38} {r.where}" for r in rows]
    return "\n".join(lines)
