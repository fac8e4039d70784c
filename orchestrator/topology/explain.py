"""pydantic's validation errors rewritten as an operator's problem lines ("unknown key 'gpu' — did you mean
'gpus'?"), from the schema itself (allowed keys, field descriptions), so it never drifts from the models.
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_SCHEMA_HINT = "see the commented topology.yaml at the repository root"
_SET_BY_LOADER = frozenset({"role"})


def explain_pydantic_error(error: dict[str, Any], root: type[BaseModel]) -> tuple[str, str]:
    """``(message, fix)`` for one entry of ``ValidationError.errors()`` raised while validating ``root``."""
    kind, loc, ctx = error["type"], tuple(error["loc"]), error.get("ctx") or {}
    value = _show(error.get("input"))
    key = str(loc[-1]) if loc else "topology"
    if kind == "extra_forbidden":
        derived = getattr(_model_at(root, loc[:-1]), "DERIVED", {})
        if key in derived:
            return f"{key!r} is derived by the orchestrator, not written in the topology", f"remove it; {derived[key]}"
        allowed = sorted(set(_fields_at(root, loc[:-1])) - _SET_BY_LOADER)
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else "remove it; "
        return f"unknown key {key!r}", f"{hint}allowed here: {', '.join(allowed) or 'none'}"
    if kind == "missing":
        info = _fields_at(root, loc[:-1]).get(key)
        description = info.description if info is not None else None
        return f"required key {key!r} is missing", f"add '{key}:' here" + (f" ({description})" if description else "")
    if kind == "literal_error":
        return f"unknown {key} {value}", f"use one of: {ctx.get('expected', '')}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {value}", "write an integer without quotes or a fraction"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {value}", "write a number without quotes"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        if key.endswith("port"):
            return f"port {value} is out of range", "use a port in 1..65535 (below 32768 avoids ephemeral ports)"
        bound = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        limit = next(iter(ctx.values()), "")
        return f"{value} is out of range", f"use a value {bound} {limit}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {value}", "write true or false without quotes"
    if kind == "string_type":
        return f"expected text, got {value}", "write a string (quote it if YAML reads it as a number or null)"
    if kind == "list_type":
        return f"expected a list, got {value}", "write a YAML list: [a, b], or one '- item' line per entry"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        info = _fields_at(root, loc[:-1]).get(key)
        optional = info is not None and not info.is_required()
        return f"expected a mapping, got {value}", "write 'key: value' lines indented under it" + (
            ", or remove the key to get the defaults" if optional and error.get("input") is None else "")
    if kind == "too_short":
        if key == "nodes":
            return "nodes needs at least one node, got none", (
                "add one, e.g. '- {name: local, address: 127.0.0.1}', or remove 'nodes' to get that default")
        return f"{key} needs at least one worker, got none", "add a worker; see examples/local.yaml"
    if kind == "string_too_short":
        return "must not be empty", "write a value, or remove the key to get the default"
    if kind == "string_pattern_mismatch":
        if key == "address":
            return f"{value} is not a host:port address", (
                'write "host:port" (e.g. "10.0.0.1:6379"), or null to start a local Ray head')
        return f"{value} is not a valid name", (
            "use lowercase letters, digits and '-', starting and ending with a letter or digit (e.g. prefill-0)")
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, "), _SCHEMA_HINT
    return str(error["msg"]), _SCHEMA_HINT


def _fields_at(root: type[BaseModel], loc: tuple[Any, ...]) -> dict[str, FieldInfo]:
    """The fields of the model found by walking ``loc`` from ``root``; {} if there is none."""
    model = _model_at(root, loc)
    return dict(model.model_fields) if model is not None else {}


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model found by walking ``loc`` from ``root``; None if there is none."""
    current: Any = root
    for part in loc:
        current = _unwrap_optional(current)
        if isinstance(part, int) and get_origin(current) is list and get_args(current):
            current = get_args(current)[0]
        elif isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[part].annotation
        else:
            return None
    current = _unwrap_optional(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
