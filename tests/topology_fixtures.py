"""Topology texts and helpers shared by the topology tests: a valid embedded and a valid sglang layout."""

from __future__ import annotations

import pytest

from dsv4_cluster.orchestrator.topology.load import Problem, TopologyError, parse_topology

BASE = """\
engine: embedded
model:
  name: dsv4-tiny
  context_length: 2048
router:
  host: 0.0.0.0
  port: 30001
defaults:
  page_size: 16
  kv_cache_dtype: auto
  max_total_tokens: 16384
prefill:
  - name: prefill-0
    device: cpu
    port: 30100
    bootstrap_port: 8998
decode:
  - name: decode-0
    device: cpu
    port: 30200
"""

SGLANG = """\
engine: sglang
model:
  name: DeepSeek-V4-Flash
  path: deepseek-ai/DeepSeek-V4-Flash
  context_length: 131072
prefill:
  - name: prefill-0
    device: cuda
    gpus: [0, 1]
    tp: 2
    port: 30100
    nccl_port: 30110
    bootstrap_port: 8998
decode:
  - name: decode-0
    device: cuda
    gpus: [2, 3]
    tp: 2
    port: 30200
    nccl_port: 30210
"""


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"fixture edit {old!r} must match exactly once"
    return text.replace(old, new)


def problems(text: str) -> list[Problem]:
    with pytest.raises(TopologyError) as info:
        parse_topology(text, source="t.yaml")
    return info.value.problems


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits[occurrence - 1]


def only(found: list[Problem], field: str) -> Problem:
    matching = [p for p in found if p.field == field]
    assert len(matching) == 1, f"expected one problem at {field}, got {[str(p) for p in found]}"
    return matching[0]


def check(text: str, field: str, line: int | None, message: str, fix: str) -> Problem:
    problem = only(problems(text), field)
    assert problem.line == line, str(problem)
    assert message in problem.message, str(problem)
    assert fix in problem.fix, str(problem)
    if line is not None:
        assert str(problem).startswith(f"t.yaml:{line}: {field}: ")
    return problem
