"""The router's settings as dotted keys (`policy.prefix.threshold`), walked from the models, never listed by hand.

Three readers: docs/router.md's tables (`python -m dsv4_cluster.router.settings_fields --write docs/router.md`
regenerates them; a test checks they are current), `dsv4-cluster plan`'s printout (`summary`), and the tests that
set every operator setting in a topology and read it back from the router's settings file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .settings import OperatorSettings, RouterSettings

_LIMITS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every setting of `model` that holds a value: (dotted key, field), nested settings models walked into."""
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from leaves(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def value_at(settings: BaseModel, key: str) -> Any:
    for part in key.split("."):
        settings = getattr(settings, part)
    return settings


def derived_fields() -> list[str]:
    """The settings the orchestrator fills, not the operator: `RouterSettings` beyond `OperatorSettings`."""
    return [name for name in RouterSettings.model_fields if name not in OperatorSettings.model_fields]


def show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def limit(info: FieldInfo) -> str:
    parts = [f"{sign} {getattr(m, attr)}" for m in info.metadata for attr, sign in _LIMITS
             if getattr(m, attr, None) is not None]
    parts += ["not empty" if m.min_length == 1 else f"≥ {m.min_length} characters" for m in info.metadata
              if getattr(m, "min_length", None)]
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    return "required" if info.is_required() else show(info.get_default(call_default_factory=True))


def table(rows: list[tuple[str, FieldInfo]]) -> str:
    lines = ["| key | default | limit | what |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {_default(info)} | {limit(info)} | {info.description or ''} |" for key, info in rows]
    return "\n".join(lines)


def tables() -> dict[str, str]:
    """docs/router.md's generated tables, by the name in their markers."""
    return {"operator settings": table(list(leaves(OperatorSettings))),
            "derived settings": table([(name, RouterSettings.model_fields[name]) for name in derived_fields()])}


def with_tables(text: str) -> str:
    """`text` with each `<!-- generated: NAME -->` … `<!-- end: NAME -->` block holding the current table."""
    for name, body in tables().items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- generated: {name} -->' … '<!-- end: {name} -->' block to fill")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def summary(settings: RouterSettings) -> list[str]:
    """What an operator checks before `up`: where the router listens, its workers, every setting (never a key)."""
    keys = ("file " + settings.api_keys_file if settings.api_keys_file else
            "env " + settings.api_keys_env if settings.api_keys_env else
            f"{len(settings.api_keys)} inline" if settings.api_keys else "none (no key asked for)")
    values = ", ".join(f"{key}={show(value_at(settings, key))}" for key, _ in leaves(OperatorSettings))
    return [f"listens on http://{settings.host}:{settings.port} (model {settings.model_name!r}; "
            f"prefill {[w.name for w in settings.prefill]}, decode {[w.name for w in settings.decode]}); "
            f"API keys: {keys}", *textwrap.wrap(f"settings: {values}", 112, subsequent_indent="  ")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4_cluster.router.settings_fields",
                                     description="Print the settings tables, or fill them into a markdown file.")
    parser.add_argument("--write", type=Path, metavar="FILE", help="fill the generated blocks of FILE in place")
    args = parser.parse_args(argv)
    if args.write is None:
        print("\n\n".join(tables().values()))
        return 0
    args.write.write_text(with_tables(args.write.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
