"""The topology rules that relate several fields: exclusive GPUs and ports, P/D agreement, engine needs.

They run on the raw parsed data, not on a validated ``Topology``, so that one pass reports them
beside pydantic's per-field errors even when some unrelated field failed to parse. Each rule
therefore looks only at values of the right type and leaves wrong types to the schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel

from .errors import format_field
from dsv4_cluster.core import KERNEL_NAMES

from dsv4_cluster.orchestrator.launch.sglang import DSV4_PAGE_SIZE, KERNELS_NEED_KV_DTYPE, SGLANG_KV_DTYPE
from .schema import (
    ENGINE_DEFAULTS, Device, EngineName, KernelsConfig, KvCacheDtype, RouterConfig, WorkerConfig, WorkerDefaults,
    default_nodes)

Path_ = tuple[Any, ...]
ROLES = ("prefill", "decode")
EMBEDDED_COMPRESS_RATIO = 4  # one compressed (C4) KV entry per 4 tokens; pages must hold whole entries


@dataclass(frozen=True)
class Finding:
    path: Path_
    message: str
    fix: str


@dataclass(frozen=True)
class _Worker:
    role: str
    index: int
    raw: dict[Any, Any]

    @property
    def path(self) -> Path_:
        return (self.role, self.index)

    @property
    def label(self) -> str:
        name = self.raw.get("name")
        where = f"{self.role}[{self.index}]"
        return f"{name} ({where})" if isinstance(name, str) else where


@dataclass(frozen=True)
class _Context:
    data: dict[Any, Any]
    workers: tuple[_Worker, ...]
    nodes: dict[str, str]  # node name -> address, for the well-formed nodes
    first_node: str | None

    @property
    def engine(self) -> str | None:
        engine = self.data.get("engine")
        return engine if engine in get_args(EngineName) else None

    def section(self, name: str) -> dict[Any, Any]:
        value = self.data.get(name)
        return value if isinstance(value, dict) else {}

    def node_of(self, raw: dict[Any, Any]) -> str | None:
        node = raw.get("node")
        return self.first_node if node is None else node if isinstance(node, str) else None

    def host_key(self, node: str | None) -> str | None:
        """Ports and GPUs are shared per host: two node names with one address are one host."""
        return None if node is None else self.nodes.get(node, node)

    def resolved(self, worker: _Worker, key: str) -> tuple[Any, Path_]:
        """The value a worker ends up with for a defaulted field, and where it was written."""
        if worker.raw.get(key) is not None:
            return worker.raw[key], worker.path + (key,)
        defaults = self.section("defaults")
        if defaults.get(key) is not None:
            return defaults[key], ("defaults", key)
        engine_default = ENGINE_DEFAULTS.get(self.engine or "", {}).get(key)
        return engine_default if engine_default is not None else WorkerDefaults.model_fields[key].default, \
            ("defaults", key)

    def written(self, worker: _Worker, key: str) -> bool:
        """Whether the file sets `key` for this worker (itself or under defaults)."""
        return worker.raw.get(key) is not None or self.section("defaults").get(key) is not None

    @property
    def kernels_requested(self) -> list[str]:
        kernels = self.section("kernels")
        return [k for k in KERNEL_NAMES if kernels.get(k, KernelsConfig.model_fields[k].default) is True]


def _context(data: dict[Any, Any]) -> _Context:
    workers = []
    for role in ROLES:
        items = data.get(role)
        if isinstance(items, list):
            workers += [_Worker(role, i, w) for i, w in enumerate(items) if isinstance(w, dict)]
    raw_nodes = data.get("nodes")
    if raw_nodes is None:
        nodes = {node.name: node.address for node in default_nodes()}
    else:
        nodes = {
            n["name"]: n["address"] if isinstance(n.get("address"), str) else n["name"]
            for n in (raw_nodes if isinstance(raw_nodes, list) else [])
            if isinstance(n, dict) and isinstance(n.get("name"), str)
        }
    return _Context(data, tuple(workers), nodes, next(iter(nodes), None))


def _get(raw: dict[Any, Any], model: type[BaseModel], key: str) -> Any:
    """The raw value, or the schema's default when the key is absent."""
    return raw[key] if key in raw else model.model_fields[key].get_default(call_default_factory=True)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_rules(data: dict[Any, Any]) -> list[Finding]:
    """Every cross-field problem of the raw topology data, in rule order."""
    ctx = _context(data)
    return [finding for rule in RULES for finding in rule(ctx)]


def _role_matches_list(ctx: _Context) -> Iterator[Finding]:
    for w in ctx.workers:
        if "role" in w.raw and w.raw["role"] != w.role:
            yield Finding(w.path + ("role",), f"worker listed under {w.role} says role: {w.raw['role']!r}",
                          "remove 'role': the list a worker is in sets it (move the worker to the other list "
                          "if that is what you meant)")


def _names_unique(ctx: _Context) -> Iterator[Finding]:
    seen: dict[str, _Worker] = {}
    for w in ctx.workers:
        name = w.raw.get("name")
        if not isinstance(name, str):
            continue
        if name in seen:
            first = format_field(seen[name].path)
            yield Finding(w.path + ("name",), f"worker name {name!r} is also used by {first}",
                          "give every worker a unique name")
        seen.setdefault(name, w)
    raw_nodes = ctx.data.get("nodes")
    names: dict[str, int] = {}
    for i, node in enumerate(raw_nodes if isinstance(raw_nodes, list) else []):
        name = node.get("name") if isinstance(node, dict) else None
        if isinstance(name, str) and name in names:
            yield Finding(("nodes", i, "name"), f"node name {name!r} is also used by nodes[{names[name]}]",
                          "give every node a unique name")
        if isinstance(name, str):
            names.setdefault(name, i)


def _nodes_known(ctx: _Context) -> Iterator[Finding]:
    if ctx.data.get("nodes") is not None and not isinstance(ctx.data.get("nodes"), list):
        return
    known = ", ".join(ctx.nodes) or "none"
    users = [(w.path, w.raw) for w in ctx.workers] + [(("router",), ctx.section("router"))]
    for path, raw in users:
        node = raw.get("node")
        if isinstance(node, str) and node not in ctx.nodes:
            yield Finding(path + ("node",), f"unknown node {node!r}",
                          f"use one of the names under 'nodes:' ({known}), or add a node named {node!r}")


def _device_gpus_tp(ctx: _Context) -> Iterator[Finding]:
    for w in ctx.workers:
        device, gpus = _get(w.raw, WorkerConfig, "device"), _get(w.raw, WorkerConfig, "gpus")
        tp = _int(_get(w.raw, WorkerConfig, "tp"))
        if device not in get_args(Device) or not isinstance(gpus, list):
            continue
        if device == "cpu":
            if gpus:
                yield Finding(w.path + ("gpus",), f"device cpu takes no GPUs, got {gpus}",
                              "remove 'gpus', or set device: cuda")
            if tp is not None and tp != 1:
                yield Finding(w.path + ("tp",), f"device cpu runs tp: 1 only, got tp: {tp}",
                              "set tp: 1, or device: cuda with one GPU per TP rank")
            continue
        if not gpus:
            yield Finding(w.path + ("gpus",), "device cuda needs GPUs, none listed",
                          "list one GPU index per TP rank, e.g. gpus: [0, 1, 2, 3] with tp: 4")
        elif tp is not None and tp != len(gpus):
            yield Finding(w.path + ("tp",), f"tp is {tp} but {len(gpus)} GPU(s) are listed in gpus",
                          f"set tp: {len(gpus)}, or list exactly {tp} GPUs (one per TP rank)")


def _gpus_exclusive(ctx: _Context) -> Iterator[Finding]:
    """SGLang workers own their GPUs; embedded workers (one process each) may share one (examples/gpu.yaml)."""
    owners: dict[tuple[str, int], _Worker] = {}
    for w in ctx.workers if ctx.engine != "embedded" else ():
        gpus, host = w.raw.get("gpus"), ctx.host_key(ctx.node_of(w.raw))
        if _get(w.raw, WorkerConfig, "device") != "cuda" or not isinstance(gpus, list) or host is None:
            continue
        for j, gpu in enumerate(gpus):
            if _int(gpu) is None:
                continue
            first = owners.setdefault((host, gpu), w)
            if first is not w:
                yield Finding(w.path + ("gpus", j), f"GPU {gpu} on node {ctx.node_of(w.raw)!r} is given to both "
                              f"{first.label} and {w.label}", "give each GPU to one worker only")
            elif gpus.index(gpu) != j:
                yield Finding(w.path + ("gpus", j), f"GPU {gpu} is listed twice in {w.label}",
                              "list each GPU once (one per TP rank)")


def _ports_distinct(ctx: _Context) -> Iterator[Finding]:
    taken: dict[tuple[str, int], tuple[Path_, str]] = {}
    router = ctx.section("router")
    router_port = _int(_get(router, RouterConfig, "port"))
    router_host = ctx.host_key(ctx.node_of(router))
    if router_port is not None and router_host is not None:
        taken[(router_host, router_port)] = (("router", "port"), "")
    for w in ctx.workers:
        host = ctx.host_key(ctx.node_of(w.raw))
        for key in ("port", "nccl_port", "bootstrap_port"):
            port = _int(w.raw.get(key))
            if port is None or host is None:
                continue
            path = w.path + (key,)
            first_path, owner = taken.setdefault((host, port), (path, w.label))
            if first_path != path:
                yield Finding(path, f"port {port} on node {ctx.node_of(w.raw)!r} is also {format_field(first_path)}"
                              + (f" of {owner}" if owner else ""), "give every port on one host a different, free value"
                              + (" (the router owns its port)" if first_path == ("router", "port") else ""))


def _bootstrap_ports(ctx: _Context) -> Iterator[Finding]:
    for w in ctx.workers:
        has = w.raw.get("bootstrap_port") is not None
        if w.role == "prefill" and not has:
            yield Finding(w.path + ("bootstrap_port",), f"prefill worker {w.label} has no bootstrap_port",
                          "add bootstrap_port: <free port>, e.g. 8998 (decode workers fetch KV routes from it)")
        if w.role == "decode" and has:
            yield Finding(w.path + ("bootstrap_port",), "decode workers run no bootstrap server",
                          "remove bootstrap_port from this decode worker")


def _engine_needs(ctx: _Context) -> Iterator[Finding]:
    if ctx.engine == "sglang":
        if ctx.section("model").get("path") is None and isinstance(ctx.data.get("model"), dict):
            yield Finding(("model", "path"), "engine sglang needs the weights, model.path is not set",
                          "set model.path to a Hugging Face id or local folder, e.g. deepseek-ai/DeepSeek-V4-Flash")
        if ctx.section("transfer").get("backend") == "tcp":
            yield Finding(("transfer", "backend"), "SGLang has no tcp KV transfer backend",
                          "use backend: nixl with engine sglang (tcp exists for the embedded engine only)")
        for w in ctx.workers:
            if w.raw.get("nccl_port") is None:
                yield Finding(w.path + ("nccl_port",), f"engine sglang needs an nccl_port for {w.label}",
                              "add nccl_port: <free port> (the TP group's NCCL rendezvous)")
            if _get(w.raw, WorkerConfig, "device") == "cpu":
                yield Finding(w.path + ("device",), f"engine sglang serves on CUDA only, {w.label} is on cpu",
                              "set device: cuda with gpus and tp, or use engine: embedded on CPU")
            gpus = w.raw.get("gpus")
            if isinstance(gpus, list) and gpus and all(_int(g) is not None for g in gpus) \
                    and gpus != list(range(gpus[0], gpus[0] + len(gpus))):
                yield Finding(w.path + ("gpus",), f"engine sglang places {w.label}'s TP ranks on --base-gpu-id and the "
                              f"GPUs after it, so its GPUs must be consecutive and ascending; got {gpus}",
                              f"list consecutive GPUs, e.g. {list(range(min(gpus), min(gpus) + len(gpus)))}")
        yield from _sglang_kv_layout(ctx)
    if ctx.engine == "embedded":
        yield from _embedded_options(ctx)
        lacking = [w.label for w in ctx.workers if ctx.resolved(w, "max_total_tokens")[0] is None]
        if lacking:
            yield Finding(("defaults", "max_total_tokens"), f"the embedded engine needs a KV pool size; "
                          f"{', '.join(lacking)} have none", "set defaults.max_total_tokens (e.g. 16384) or "
                          "max_total_tokens on each worker")
        reported: set[Path_] = set()
        for w in ctx.workers:
            size, path = ctx.resolved(w, "page_size")
            if _int(size) and size > 0 and size % EMBEDDED_COMPRESS_RATIO and path not in reported:
                reported.add(path)
                yield Finding(path, f"page_size {size} is not a multiple of {EMBEDDED_COMPRESS_RATIO} (the embedded "
                              "model's compression ratio: a page must hold whole compressed entries)",
                              "use a multiple of 4, e.g. 16 or 64")


def _once(ctx: _Context, key: str) -> Iterator[tuple[_Worker, Any, Path_]]:
    """Each distinct place the file sets `key` (a worker or defaults), with its resolved value, once."""
    reported: set[Path_] = set()
    for w in ctx.workers:
        value, path = ctx.resolved(w, key)
        if path not in reported:
            reported.add(path)
            yield w, value, path


def _sglang_kv_layout(ctx: _Context) -> Iterator[Finding]:
    """SGLang 0.5.23 DeepSeek-V4: 256-token pages whatever it is told; fp8 KV for the kernels."""
    for w, size, path in _once(ctx, "page_size"):
        if ctx.written(w, "page_size") and _int(size) is not None and size != DSV4_PAGE_SIZE:
            yield Finding(path, f"page_size {size}: SGLang 0.5.23 runs DeepSeek-V4 with {DSV4_PAGE_SIZE}-token pages "
                          "whatever --page-size says", f"set page_size: {DSV4_PAGE_SIZE}, or remove it")
    kernels = ctx.kernels_requested
    for w, dtype, path in _once(ctx, "kv_cache_dtype"):
        if dtype in SGLANG_KV_DTYPE and kernels and SGLANG_KV_DTYPE[dtype] != KERNELS_NEED_KV_DTYPE:
            yield Finding(path, f"kv_cache_dtype {dtype} (SGLang {SGLANG_KV_DTYPE[dtype]}) with kernels "
                          f"{', '.join(kernels)}: the kernels read SGLang's fp8 KV rows only",
                          f"set kv_cache_dtype: {KERNELS_NEED_KV_DTYPE}, or set those kernels.* to false")


def _embedded_options(ctx: _Context) -> Iterator[Finding]:
    """What the embedded engine's workers would refuse at start (workers/args.py), said before anything starts."""
    if ctx.section("transfer").get("backend") == "tcp":
        yield Finding(("transfer", "backend"), "the embedded engine moves KV over NIXL only (no tcp backend)",
                      "use backend: nixl")
    raw_kernels = ctx.section("kernels") or {}
    kernels = [k for k, f in KernelsConfig.model_fields.items() if raw_kernels.get(k, f.default) is True]
    for w in ctx.workers:
        if _get(w.raw, WorkerConfig, "device") == "cuda" and kernels and embedded_preset(w.raw) != "flash":
            yield Finding(w.path + ("device",), f"{w.label} runs the embedded engine on cuda with kernels "
                          f"{', '.join(kernels)}, but its model preset is {embedded_preset(w.raw)!r}, whose shapes "
                          "the kernels do not take (they take 512 dims, 16/32/64 heads)",
                          'add extra_args: ["--model-preset", "flash"] (examples/gpu.yaml), or set the kernels off')
        gpus = _get(w.raw, WorkerConfig, "gpus")
        if _get(w.raw, WorkerConfig, "device") == "cuda" and isinstance(gpus, list) and len(gpus) > 1:
            yield Finding(w.path + ("gpus",), f"{w.label} lists {len(gpus)} GPUs, but an embedded worker is one "
                          "process on one GPU (no tensor parallelism)",
                          "list one GPU (e.g. gpus: [1]); more workers take more GPUs (examples/gpu2.yaml)")
    yield from _embedded_kv_layout(ctx)


def _embedded_kv_layout(ctx: _Context) -> Iterator[Finding]:
    """kv_cache_dtype and page_size against each worker's preset, as the worker checks them (workers/args.py)."""
    from dsv4_cluster.workers.presets import PRESETS, KVDtypeError, kv_layout_dtype, pool_layout

    reported: set[Path_] = set()
    for w in ctx.workers:
        dtype, dtype_path = ctx.resolved(w, "kv_cache_dtype")
        page, page_path = ctx.resolved(w, "page_size")
        cfg = PRESETS.get(embedded_preset(w.raw))
        if dtype not in get_args(KvCacheDtype) or _int(page) is None or page <= 0 or page % 4 or cfg is None:
            continue
        try:
            layout = kv_layout_dtype(dtype, cfg, str(_get(w.raw, WorkerConfig, "device")))
        except KVDtypeError as exc:
            found = (dtype_path, str(exc), "set kv_cache_dtype: auto, or remove it")
        else:
            problems = pool_layout(cfg, layout, page, 1).problems()
            found = (page_path, f"{w.label} ({embedded_preset(w.raw)} preset, KV {layout}): " + "; ".join(problems),
                     "set page_size: 256") if problems else None
        if found and found[0] not in reported:
            reported.add(found[0])
            yield Finding(*found)


def embedded_preset(raw: dict) -> str:
    """The `--model-preset` an embedded worker's extra_args pass (workers/presets.py), else the default 'tiny'."""
    args = [str(a) for a in raw.get("extra_args") or []]
    for i, a in enumerate(args):
        if a == "--model-preset" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--model-preset="):
            return a.split("=", 1)[1]
    return "tiny"


def _pool_fits_context(ctx: _Context) -> Iterator[Finding]:
    context = _int(ctx.section("model").get("context_length"))
    reported: set[Path_] = set()
    for w in ctx.workers:
        tokens, path = ctx.resolved(w, "max_total_tokens")
        if context and _int(tokens) and 0 < tokens < context and path not in reported:
            reported.add(path)
            yield Finding(path, f"max_total_tokens {tokens} is below model.context_length {context}: one "
                          "full-length request would not fit in the KV pool",
                          f"raise max_total_tokens to at least {context}, or lower model.context_length")


def _engine_value(ctx: _Context, key: str, value: Any) -> Any:
    """What the engine will run with for `value` of `key` (SGLang: 256-token pages, its dtype names)."""
    if ctx.engine == "sglang":
        return DSV4_PAGE_SIZE if key == "page_size" else SGLANG_KV_DTYPE.get(value, value)
    return value


def _kv_layout_agrees(ctx: _Context) -> Iterator[Finding]:
    """P and D copy KV pages as-is: page size and KV dtype must agree as the engine will run them."""
    valid = {"page_size": lambda v: _int(v) is not None and v > 0,
             "kv_cache_dtype": lambda v: v in get_args(KvCacheDtype)}
    prefills = [w for w in ctx.workers if w.role == "prefill"]
    if not prefills:
        return
    reference = prefills[0]
    for key, ok in valid.items():
        ref_value, ref_path = ctx.resolved(reference, key)
        if not ok(ref_value):
            continue
        for w in ctx.workers[1:]:
            value, path = ctx.resolved(w, key)
            if ok(value) and _engine_value(ctx, key, value) != _engine_value(ctx, key, ref_value):
                yield Finding(path, f"{key} {value!r} of {w.label} differs from {ref_value!r} of "
                              f"{reference.label} ({format_field(ref_path)})",
                              f"prefill and decode exchange KV pages as-is: use one {key} for every worker "
                              f"(set defaults.{key} and drop the per-worker values)")


RULES: tuple[Callable[[_Context], Iterator[Finding]], ...] = (
    _role_matches_list, _names_unique, _nodes_known, _device_gpus_tp, _gpus_exclusive, _ports_distinct,
    _bootstrap_ports, _engine_needs, _pool_fits_context, _kv_layout_agrees,
)
