"""What a bad topology is reported as: one ``Problem`` per mistake, all of them in one ``TopologyError``.

The CLI prints ``str(TopologyError)`` and exits with ``TopologyError.exit_code`` before starting
anything, so each line must stand alone: where (file, line, field), what is wrong, how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def format_field(path: tuple[Any, ...]) -> str:
    """``("prefill", 0, "gpus")`` → ``prefill[0].gpus``."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    field: str  # dotted path, list items by index: "decode[0].page_size"; "" = the whole file
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message} — {self.fix}"


class TopologyError(ValueError):
    """A topology that must not be started; ``problems`` lists every mistake found."""

    exit_code = 2

    def __init__(self, problems: list[Problem]) -> None:
        if not problems:
            raise ValueError("TopologyError needs at least one problem")
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class UnknownNameError(KeyError):
    """A lookup by name (``Topology.worker``, ``Topology.node``) for a name the topology lacks."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, list(known)
        super().__init__(f"no {kind} named {name!r} in the topology; known: {', '.join(known) or 'none'}")

    def __str__(self) -> str:
        return str(self.args[0])
