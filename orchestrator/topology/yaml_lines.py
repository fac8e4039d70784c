"""A YAML document read with the line of every key and list item (PyYAML's `safe_load` drops positions and
silently collapses duplicate keys; both are recorded here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[Any, ...]  # ("prefill", 0, "gpus") — keys and list indices from the root


class YamlSyntaxError(ValueError):
    """The text is not one well-formed YAML document; ``line`` is 1-based when known."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


@dataclass(frozen=True)
class YamlDocument:
    """Plain data (dicts, lists, scalars) plus where each part was written."""

    data: Any
    lines: dict[Path_, int] = field(default_factory=dict)
    duplicate_keys: tuple[tuple[Path_, int, int], ...] = ()  # (path, first line, repeated line)

    def line_of(self, path: Path_) -> int | None:
        """Line of ``path``, else of its nearest written ancestor (a missing key → its parent)."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(tuple(path[:end]))
            if line is not None:
                return line
        return None


def read_yaml(text: str) -> YamlDocument:
    """Parse one YAML document with line numbers; raise ``YamlSyntaxError`` if it is malformed."""
    try:   # the reader checks the characters already when the loader is built (ReaderError)
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{exc}; remove control characters, the file must be printable text", None) from exc
    try:
        root = loader.get_single_node()
        if root is None:
            return YamlDocument(data=None)
        builder = _Builder(loader)
        data = builder.build(root, ())
        return YamlDocument(data, builder.lines, tuple(builder.duplicates))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        raise YamlSyntaxError(what or str(exc), line) from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(str(exc), None) from exc
    finally:
        loader.dispose()


class _Builder:
    """Walks the composed node tree once, constructing scalars with PyYAML's safe rules."""

    def __init__(self, loader: yaml.SafeLoader) -> None:
        self._loader = loader
        self.lines: dict[Path_, int] = {}
        self.duplicates: list[tuple[Path_, int, int]] = []
        self._active: set[int] = set()  # node ids on the current branch: catches recursive aliases

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if id(node) in self._active:
            raise yaml.constructor.ConstructorError(
                None, None, "found a recursive alias (an anchor that contains itself)", node.start_mark
            )
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            if isinstance(node, yaml.SequenceNode):
                return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
            return self._loader.construct_object(node, deep=True)
        finally:
            self._active.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, path: Path_) -> dict[Any, Any]:
        own = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
        self._loader.flatten_mapping(node)  # "<<: *anchor" merges: merged pairs first, then the node's own
        merged = len(node.value) - own
        out: dict[Any, Any] = {}
        own_keys: set[Any] = set()
        for index, (key_node, value_node) in enumerate(node.value):
            key = self._loader.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                raise yaml.constructor.ConstructorError(
                    None, None, "found a list or mapping used as a key", key_node.start_mark
                )
            child = path + (key,)
            if index >= merged:  # a merged key may be overridden; the node's own key only once
                if key in own_keys:
                    self.duplicates.append((child, self.lines[child], key_node.start_mark.line + 1))
                own_keys.add(key)
            self.lines[child] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, child)
        return out
