"""Hypothesis on the topology loader: any mutation of a valid topology (a value replaced by junk, a key
dropped, an unknown key added) and any text loads or fails with a TopologyError whose every problem says
where (the field), what and how to fix it; never another exception (a traceback for the user)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_cluster.orchestrator.topology.load import (TopologyError, format_field, parse_topology,
                                                 topology_from_data)

BASE: dict[str, Any] = {
    "engine": "embedded",
    "model": {"name": "dsv4-tiny", "seed": 0, "context_length": 2048},
    "cluster": {"address": None, "namespace": "dsv4-cluster", "run_dir": "run"},
    "router": {"host": "127.0.0.1", "port": 30001},
    "transfer": {"backend": "nixl"},
    "kernels": {"sparse_mla_decode": True, "indexer": True, "topk": True},
    "defaults": {"page_size": 16, "kv_cache_dtype": "auto", "max_total_tokens": 16384},
    "prefill": [{"name": "prefill-0", "device": "cpu", "port": 30100, "bootstrap_port": 8998}],
    "decode": [{"name": "decode-0", "device": "cpu", "port": 30200}],
}

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


PATHS = _paths(BASE)


def _set(doc: dict, path: tuple, value: Any, drop: bool) -> None:
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if drop and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


def _assert_clear(exc: TopologyError) -> None:
    assert exc.problems
    for p in exc.problems:
        assert p.message.strip() and p.fix.strip(), p


def test_the_base_topology_loads():
    assert topology_from_data(copy.deepcopy(BASE)).model.name == "dsv4-tiny"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=JUNK, drop=st.booleans(), extra=st.booleans())
def test_a_mutated_topology_loads_or_names_the_field(path, value, drop, extra):
    doc = copy.deepcopy(BASE)
    _set(doc, path, value, drop)
    extra = extra and isinstance(doc.get("model"), dict)
    if extra:
        doc["model"]["mystery_knob"] = 1
    try:
        topology_from_data(doc)
    except TopologyError as exc:
        _assert_clear(exc)
        fields = [p.field for p in exc.problems]
        named = format_field(path[:1])   # the section the mutation hit, at least, is named
        assert any(f.startswith(named) for f in fields) or (extra and any("mystery_knob" in f for f in fields)), \
            (path, value, str(exc))
        return
    assert not extra, "an unknown field was accepted"


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300) | st.builds(lambda a, b: a + ": " + b, st.text(max_size=20), st.text(max_size=40)))
def test_any_text_loads_or_fails_with_a_topology_error(text):
    try:
        parse_topology(text)
    except TopologyError as exc:
        _assert_clear(exc)
