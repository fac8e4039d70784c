"""KV capacity each server will have, predicted from the topology before anything starts.

Embedded engine: exact (`max_total_tokens // page_size` whole pages; bytes per token from the pool layout).
SGLang: 0.5.23's DeepSeek-V4 pool sizing (`sglang_capacity`); where it cannot be followed (another SGLang, an extra
flag that changes the sizing) the row says why and predicts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4_cluster.core import Role
from dsv4_cluster.orchestrator.launch import sglang_capacity as sg

CAPACITY_TOLERANCE = 0.05  # `status` flags a server whose actual capacity misses the prediction by more
PREDICTED_COLUMN = "KV_PREDICTED"  # status: beside KV_CAPACITY (what /server_info says), what plan predicted


@dataclass(frozen=True)
class Capacity:
    server: str
    engine: str
    max_total_num_tokens: int | None  # None: not predicted (see note)
    context_length: int
    kv_bytes_per_token: float | None
    note: str = ""
    mem_fraction: float | None = None  # SGLang: the --mem-fraction-static of this row
    free_after_pool_gib: float | None = None  # SGLang: GPU memory left per GPU once weights and pool are in
    default_fraction: bool = field(default=False, compare=False)  # the fraction the server will run with

    @property
    def full_context_requests(self) -> int | None:
        if self.max_total_num_tokens is None:
            return None
        return self.max_total_num_tokens // self.context_length


def embedded_bytes_per_token(preset: str = "tiny", device: str = "cpu", kv_cache_dtype: str = "auto",
                             page_size: int = 16) -> float:
    """Bytes of the embedded pool per token of capacity for the worker's model preset, in the layout its
    --kv-cache-dtype gives on that device (auto: float32 on cpu; on cuda fp8 for flash, bf16 for tiny): one
    page's bytes over every buffer (fp8 pages with their padding, each layer's compression ratio) over its
    tokens, the pool's own formula (`kv.layout.PoolLayout.page_bytes`)."""
    from dsv4_cluster.workers.engine.presets import kv_bytes_per_token, kv_layout_dtype, model_config

    cfg = model_config(preset)
    return kv_bytes_per_token(cfg, kv_layout_dtype(kv_cache_dtype, cfg, device), page_size)


def _embedded_preset(worker: Any) -> str:
    from dsv4_cluster.orchestrator.topology.engine_rules import embedded_preset

    return embedded_preset({"extra_args": _worker_args(worker)})


def _worker_args(worker: Any) -> list[str]:
    return [str(a) for a in worker.extra_args]


def sglang_fractions(worker: Any, gpu: sg.GpuInputs) -> tuple[float, list[float]]:
    """(the fraction the server will use, the table's fractions): the worker's --mem-fraction-static,
    else SGLang's default for its role, and a spread around it."""
    explicit, unmodelled = sg.sizing_flags(_worker_args(worker))
    if unmodelled:
        raise sg.SizingError(f"extra_args {', '.join(unmodelled)} change SGLang's sizing in ways not followed here")
    role = Role(worker.role)
    used = explicit if explicit is not None else sg.default_mem_fraction(gpu.total_mib, role, worker.tp)
    return used, sorted({used, 0.80, 0.85, 0.88, 0.90, 0.92})


def predict_sglang(topology: Any, worker: Any, fraction: float | None = None,
                   gpu: sg.GpuInputs = sg.GpuInputs(), sglang_version: str | None = None) -> Capacity:
    """One SGLang server's pool at `fraction` (default: the one it will use); a row with a note when the
    sizing cannot be followed."""
    context = topology.model.context_length
    try:
        used, _ = sglang_fractions(worker, gpu)
        f = used if fraction is None else fraction
        pre, weights = gpu.pre_gib(), gpu.weights_gib(worker.tp)
        pool = sg.size_pool(sg.geometry_for(str(topology.model.path)),
                            available=sg.available_bytes(pre, weights, f), mem_fraction=f,
                            max_total_tokens=worker.max_total_tokens, page_size=worker.page_size,
                            sglang_version=sglang_version or sg.installed_sglang_version(),
                            pre_gib=pre, weights_gib=weights)
    except sg.SizingError as e:
        return Capacity(worker.name, "sglang", None, context, None, f"not predicted: {e}")
    return Capacity(worker.name, "sglang", pool.max_total_num_tokens, context, pool.bytes_per_full_token,
                    "", f, pool.free_after_pool_bytes / sg.GIB, default_fraction=f == used)


def predict(topology: Any, worker: Any) -> Capacity:
    """The KV capacity `worker` of `topology` will report as `max_total_num_tokens`."""
    engine, context = str(topology.engine), topology.model.context_length
    if engine == "embedded":
        tokens = worker.max_total_tokens // worker.page_size * worker.page_size
        return Capacity(worker.name, engine, tokens, context,
                        embedded_bytes_per_token(_embedded_preset(worker), str(worker.device),
                                                 str(worker.kv_cache_dtype), worker.page_size))
    return predict_sglang(topology, worker)


def capacity_rows(topology: Any, gpu: sg.GpuInputs = sg.GpuInputs()) -> list[Capacity]:
    """The plan's table: one row per embedded worker; per SGLang worker one row per memory fraction."""
    rows: list[Capacity] = []
    for w in topology.workers:
        if str(topology.engine) != "sglang":
            rows.append(predict(topology, w))
            continue
        try:
            _, fractions = sglang_fractions(w, gpu)
        except sg.SizingError:
            rows.append(predict_sglang(topology, w, gpu=gpu))
            continue
        rows.extend(predict_sglang(topology, w, f, gpu) for f in fractions)
    return rows


def capacity_table(rows: list[Capacity]) -> str:
    head = ("SERVER", "ENGINE", "MEM_FRACTION", "MAX_TOTAL_NUM_TOKENS", "FULL_CONTEXT_REQS", "KV_BYTES/TOKEN",
            "FREE_GIB/GPU", "NOTE")
    body = [(r.server, r.engine,
             "-" if r.mem_fraction is None else f"{r.mem_fraction:.3f}" + ("*" if r.default_fraction else ""),
             "-" if r.max_total_num_tokens is None else str(r.max_total_num_tokens),
             "-" if r.full_context_requests is None else str(r.full_context_requests),
             "-" if r.kv_bytes_per_token is None else f"{r.kv_bytes_per_token:.0f}",
             "-" if r.free_after_pool_gib is None else f"{r.free_after_pool_gib:.1f}", r.note) for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body))


def inputs_note(topology: Any, gpu: sg.GpuInputs) -> str:
    """What the SGLang rows were computed from (printed under the plan's table)."""
    if str(topology.engine) != "sglang":
        return "embedded engine: exact (whole pages of max_total_tokens)"
    tps = sorted({w.tp for w in topology.workers})
    weights = ", ".join(f"TP{tp} {gpu.weights_gib(tp):.1f}" for tp in tps)
    return (f"SGLang {sg.SIZING_VERSION} DeepSeek-V4 sizing: GPU {gpu.total_mib:.0f} MiB, free before load "
            f"{gpu.pre_gib():.1f} GiB, weights per GPU {weights} GiB (checkpoint {gpu.checkpoint_gib:g} GiB / TP); "
            "* = the fraction the server runs with (--mem-fraction-static in extra_args, else SGLang's default); "
            "FULL_CONTEXT_REQS = MAX_TOTAL_NUM_TOKENS // context_length; FREE_GIB/GPU = left after weights and pool")
