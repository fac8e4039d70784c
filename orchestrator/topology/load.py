"""Loading a topology file: every problem at once, one line each (`<file>:<line>: <field>: <what> — <fix>`).

YAML is read with line numbers (`yaml_lines`), validated by the strict schema, and the cross-field rules run on the
same raw data, so one pass reports everything. The public face of the topology: the schema is re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .errors import Problem, TopologyError, UnknownNameError, format_field
from .explain import explain_pydantic_error
from .rules import check_rules
from .schema import (
    ClusterConfig,
    EngineName,
    KernelsConfig,
    KvCacheDtype,
    ModelConfig,
    NodeConfig,
    RouterConfig,
    Topology,
    TransferConfig,
    WorkerConfig,
    WorkerDefaults,
)
from .yaml_lines import YamlDocument, YamlSyntaxError, read_yaml

__all__ = [
    "ClusterConfig", "EngineName", "KernelsConfig", "KvCacheDtype", "ModelConfig", "NodeConfig", "Problem",
    "RouterConfig", "Topology", "TopologyError", "TransferConfig", "UnknownNameError", "WorkerConfig",
    "WorkerDefaults", "format_field", "load_topology", "main", "parse_topology", "topology_from_data",
]

_EXAMPLE_HINT = "see the commented topology.yaml at the repository root or examples/local.yaml"


def load_topology(path: str | Path) -> Topology:
    """Read, validate and resolve a topology file; raise ``TopologyError`` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError([Problem(str(path), None, "", "file not found",
                                     f"check the path; to start a new one, {_EXAMPLE_HINT}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError([Problem(str(path), None, "", f"cannot read the file ({exc})",
                                     "make it a readable UTF-8 text file")]) from exc
    return parse_topology(text, source=path)


def parse_topology(text: str, source: str | Path | None = None) -> Topology:
    """Like ``load_topology`` for YAML text; ``source`` names it in messages and anchors ``cluster.run_dir``."""
    source_path = Path(source) if source is not None else None
    file = str(source_path) if source_path is not None else "<topology>"
    try:
        doc = read_yaml(text)
    except YamlSyntaxError as exc:
        fix = "fix the YAML syntax at that line (indentation, a missing ':' or quote)"
        raise TopologyError([Problem(file, exc.line, "", f"not valid YAML: {exc.message}", fix)]) from exc
    if doc.data is None:
        raise TopologyError([Problem(file, None, "", "the file is empty",
                                     f"write a topology: engine, model, prefill and decode at least; {_EXAMPLE_HINT}")])
    if not isinstance(doc.data, dict):
        fix = f"write 'key: value' lines at the top level (engine:, model:, ...); {_EXAMPLE_HINT}"
        what = f"the file holds a {_kind(doc.data)}, not a mapping"
        raise TopologyError([Problem(file, doc.line_of(()), "", what, fix)])
    return _validate(doc, file, source_path)


def topology_from_data(data: Any, source: str | Path | None = None) -> Topology:
    """Validate already-parsed data shaped like the YAML (e.g. a test fixture) with every rule, sans line numbers."""
    source_path = Path(source) if source is not None else None
    file = str(source_path) if source_path is not None else "<topology>"
    if not isinstance(data, dict):
        raise TopologyError([Problem(file, None, "", f"the topology is a {_kind(data)}, not a mapping",
                                     f"pass a dict with engine, model, prefill and decode; {_EXAMPLE_HINT}")])
    return _validate(YamlDocument(data), file, source_path)


def _validate(doc: YamlDocument, file: str, source: Path | None) -> Topology:
    problems = [
        Problem(file, again, format_field(path), f"key given twice (first on line {first})",
                "keep one of them (YAML would silently use the last)")
        for path, first, again in doc.duplicate_keys
    ]
    topology = None
    try:
        topology = Topology.model_validate(doc.data)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            loc = tuple(error["loc"])
            message, fix = explain_pydantic_error(error, Topology)
            problems.append(Problem(file, doc.line_of(loc), format_field(loc), message, fix))
    for finding in check_rules(doc.data):
        problems.append(Problem(file, doc.line_of(finding.path), format_field(finding.path),
                                finding.message, finding.fix))
    if topology is None or problems:  # pydantic never fails without at least one error
        unique = list(dict.fromkeys(problems))
        unique.sort(key=lambda p: (p.line is None, p.line or 0))
        raise TopologyError(unique)
    topology._source = source.absolute() if source is not None else None
    return topology


def _kind(value: Any) -> str:
    return "list" if isinstance(value, list) else f"single value ({value!r})"[:80]


def main(argv: list[str] | None = None) -> int:
    """Check a topology file and start nothing: 0 when it loads, ``TopologyError.exit_code`` (2) when not."""
    parser = argparse.ArgumentParser(prog="python -m dsv4_cluster.orchestrator.topology.load",
                                     description="Check a topology file; print every problem; start nothing.")
    parser.add_argument("path", type=Path, help="the topology YAML file, e.g. topology.yaml")
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.path)
    except TopologyError as exc:
        print(exc, file=sys.stderr)
        print(f"{len(exc.problems)} problem(s) in {args.path}; nothing was started", file=sys.stderr)
        return exc.exit_code
    print(f"{args.path}: ok — engine {topology.engine}, {len(topology.prefill)} prefill + "
          f"{len(topology.decode)} decode, router {topology.router.host}:{topology.router.port}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
