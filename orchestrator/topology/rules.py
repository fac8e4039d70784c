"""The topology rules that relate several fields: exclusive GPUs and ports, P/D agreement, engine needs. They run on
the raw data, beside pydantic's per-field errors, so each looks only at values of the right type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, get_args

from dsv4_cluster.core import Role
from .errors import format_field
from dsv4_cluster.orchestrator.launch.sglang_facts import DSV4_PAGE_SIZE, SGLANG_KV_DTYPE
from .engine_rules import engine_needs
from .rule_context import Finding, Path_, RuleContext, WorkerEntry, as_int, build_context, field_value
from .schema import Device, KvCacheDtype, RouterConfig, WorkerConfig


def check_rules(data: dict[Any, Any]) -> list[Finding]:
    """Every cross-field problem of the raw topology data, in rule order."""
    ctx = build_context(data)
    return [finding for rule in RULES for finding in rule(ctx)]


def _role_matches_list(ctx: RuleContext) -> Iterator[Finding]:
    for w in ctx.workers:
        if "role" in w.raw and w.raw["role"] != w.role:
            yield Finding(w.path + ("role",), f"worker listed under {w.role.value} says role: {w.raw['role']!r}",
                          "remove 'role': the list a worker is in sets it (move the worker to the other list "
                          "if that is what you meant)")


def _names_unique(ctx: RuleContext) -> Iterator[Finding]:
    seen: dict[str, WorkerEntry] = {}
    for w in ctx.workers:
        name = w.raw.get("name")
        if not isinstance(name, str):
            continue
        if name == Role.ROUTER.value:
            yield Finding(w.path + ("name",), f"worker name {name!r} is the router's own process name",
                          "rename the worker")
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


def _nodes_known(ctx: RuleContext) -> Iterator[Finding]:
    if ctx.data.get("nodes") is not None and not isinstance(ctx.data.get("nodes"), list):
        return
    known = ", ".join(ctx.nodes) or "none"
    users = [(w.path, w.raw) for w in ctx.workers] + [(("router",), ctx.section("router"))]
    for path, raw in users:
        node = raw.get("node")
        if isinstance(node, str) and node not in ctx.nodes:
            yield Finding(path + ("node",), f"unknown node {node!r}",
                          f"use one of the names under 'nodes:' ({known}), or add a node named {node!r}")


def _device_gpus_tp(ctx: RuleContext) -> Iterator[Finding]:
    for w in ctx.workers:
        device, gpus = field_value(w.raw, WorkerConfig, "device"), field_value(w.raw, WorkerConfig, "gpus")
        tp = as_int(field_value(w.raw, WorkerConfig, "tp"))
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


def _gpus_exclusive(ctx: RuleContext) -> Iterator[Finding]:
    """SGLang workers own their GPUs; embedded workers (one process each) may share one (examples/gpu.yaml)."""
    owners: dict[tuple[str, int], WorkerEntry] = {}
    for w in ctx.workers if ctx.engine != "embedded" else ():
        gpus, host = w.raw.get("gpus"), ctx.host_key(ctx.node_of(w.raw))
        if field_value(w.raw, WorkerConfig, "device") != "cuda" or not isinstance(gpus, list) or host is None:
            continue
        for j, gpu in enumerate(gpus):
            if as_int(gpu) is None:
                continue
            first = owners.setdefault((host, gpu), w)
            if first is not w:
                yield Finding(w.path + ("gpus", j), f"GPU {gpu} on node {ctx.node_of(w.raw)!r} is given to both "
                              f"{first.label} and {w.label}", "give each GPU to one worker only")
            elif gpus.index(gpu) != j:
                yield Finding(w.path + ("gpus", j), f"GPU {gpu} is listed twice in {w.label}",
                              "list each GPU once (one per TP rank)")


def _ports_distinct(ctx: RuleContext) -> Iterator[Finding]:
    taken: dict[tuple[str, int], tuple[Path_, str]] = {}
    router = ctx.section("router")
    router_port = as_int(field_value(router, RouterConfig, "port"))
    router_host = ctx.host_key(ctx.node_of(router))
    if router_port is not None and router_host is not None:
        taken[(router_host, router_port)] = (("router", "port"), "")
    for w in ctx.workers:
        host = ctx.host_key(ctx.node_of(w.raw))
        for key in ("port", "nccl_port", "bootstrap_port"):
            port = as_int(w.raw.get(key))
            if port is None or host is None:
                continue
            path = w.path + (key,)
            first_path, owner = taken.setdefault((host, port), (path, w.label))
            if first_path != path:
                yield Finding(path, f"port {port} on node {ctx.node_of(w.raw)!r} is also {format_field(first_path)}"
                              + (f" of {owner}" if owner else ""), "give every port on one host a different, free value"
                              + (" (the router owns its port)" if first_path == ("router", "port") else ""))


def _bootstrap_ports(ctx: RuleContext) -> Iterator[Finding]:
    for w in ctx.workers:
        has = w.raw.get("bootstrap_port") is not None
        if w.role is Role.PREFILL and not has:
            yield Finding(w.path + ("bootstrap_port",), f"prefill worker {w.label} has no bootstrap_port",
                          "add bootstrap_port: <free port>, e.g. 8998 (decode workers fetch KV routes from it)")
        if w.role is Role.DECODE and has:
            yield Finding(w.path + ("bootstrap_port",), "decode workers run no bootstrap server",
                          "remove bootstrap_port from this decode worker")


def _pool_fits_context(ctx: RuleContext) -> Iterator[Finding]:
    """One full-length request fits the pool's whole pages (a worker refuses the rest at start)."""
    context = as_int(ctx.section("model").get("context_length"))
    reported: set[Path_] = set()
    for w in ctx.workers:
        tokens, path = ctx.resolved(w, "max_total_tokens")
        page = as_int(_engine_value(ctx, "page_size", ctx.resolved(w, "page_size")[0]))
        page = page if page and page > 0 else 1
        if not (context and as_int(tokens) and tokens > 0) or path in reported:
            continue
        held = tokens // page * page
        if held < context:
            reported.add(path)
            pages = f": its whole pages of {page} tokens hold {held}," if held < tokens else " is"
            least = -(-context // page) * page   # whole pages too: the workers refuse less
            yield Finding(path, f"max_total_tokens {tokens}{pages} below model.context_length {context}: one "
                          "full-length request would not fit in the KV pool",
                          f"raise max_total_tokens to at least {least}, or lower model.context_length")


def _engine_value(ctx: RuleContext, key: str, value: Any) -> Any:
    """What the engine will run with for `value` of `key` (SGLang: 256-token pages, its dtype names)."""
    if ctx.engine == "sglang":
        return DSV4_PAGE_SIZE if key == "page_size" else SGLANG_KV_DTYPE.get(value, value)
    return value


def _kv_layout_agrees(ctx: RuleContext) -> Iterator[Finding]:
    """P and D copy KV pages as-is: page size and KV dtype must agree as the engine will run them."""
    dtypes = SGLANG_KV_DTYPE if ctx.engine == "sglang" else get_args(KvCacheDtype)  # others: their own rule's
    valid = {"page_size": lambda v: as_int(v) is not None and v > 0, "kv_cache_dtype": lambda v: v in dtypes}
    prefills = [w for w in ctx.workers if w.role is Role.PREFILL]
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


RULES: tuple[Callable[[RuleContext], Iterator[Finding]], ...] = (
    _role_matches_list, _names_unique, _nodes_known, _device_gpus_tp, _gpus_exclusive, _ports_distinct,
    _bootstrap_ports, engine_needs, _pool_fits_context, _kv_layout_agrees,
)
