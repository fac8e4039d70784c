"""The import graph of production code (orchestrator/, router/, workers/, kernels/, dsv4_cluster/, deploy/) and of
bench/ has no cycle: each room can be read without the one that imports it. Every import counts, also one inside a
function or under TYPE_CHECKING (a cycle there is still two modules that need each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_OF = {"orchestrator": "dsv4_cluster.orchestrator", "router": "dsv4_cluster.router",
              "workers": "dsv4_cluster.workers", "kernels": "dsv4_cluster.kernels", "deploy": "dsv4_cluster.deploy",
              "dsv4_cluster": "dsv4_cluster", "bench": "bench"}


def _modules(folders: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    mods = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join([PACKAGE_OF[folder], *(parts[:-1] if is_pkg else parts)])
            mods[name] = (path, is_pkg)
    return mods


def import_graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `folders` it imports (a package's own submodules excluded from its edges)."""
    mods = _modules(folders)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("folders", [("orchestrator", "router", "workers", "kernels", "dsv4_cluster", "deploy"),
                                     ("bench",)], ids=["production", "bench"])
def test_no_import_cycles(folders):
    assert cycles(import_graph(folders)) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
