"""Read a YAML document into plain data plus the source position of every value.

We compose the YAML node graph ourselves instead of calling ``yaml.safe_load`` because we need
line/column for every document path (errors point at the offending line) and because building the
values by hand lets us bound the work: alias bombs ("billion laughs") are refused after a fixed node
budget instead of exhausting memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bpdkv.errors import Diagnostic, InvalidTopology

# Topologies are small hand-written files; anything bigger is a mistake, not a topology.
MAX_FILE_BYTES = 1024 * 1024
# Upper bound on values constructed from one document, counting each alias expansion again.
MAX_NODES = 50_000
MAX_DEPTH = 64

PathKey = tuple[str | int, ...]


@dataclass(frozen=True)
class Position:
    file: str
    line: int  # 1-based
    column: int  # 1-based


@dataclass
class SourceMap:
    """Where each document path came from (the topology file or a profile file)."""

    positions: dict[PathKey, Position] = field(default_factory=dict)

    def locate(self, path: PathKey) -> Position | None:
        """Position of ``path`` or of its nearest ancestor that has one."""
        for cut in range(len(path), -1, -1):
            pos = self.positions.get(tuple(path[:cut]))
            if pos is not None:
                return pos
        return None

    def overlay(self, other: SourceMap) -> None:
        self.positions.update(other.positions)


def format_path(path: PathKey) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass
class LoadedDocument:
    data: Any
    source: SourceMap
    file: str
    # Placeholder nodes (validate / plan --offline) of node groups without instance_type: their hardware is unknown
    # until EC2 is asked, so they are checked as machines with what their layout needs.
    unknown_hardware: frozenset[str] = frozenset()
    # Node groups that `bpdkv validate` expanded with their schema-invalid parts set aside (groups.offline_inventory):
    # the problems found, the original paths of the parts left out, and where each expanded node and instance is written.
    problems: tuple[Diagnostic, ...] = ()
    set_aside: dict[PathKey, Position | None] = field(default_factory=dict)  # where each is written
    origins: tuple[tuple[PathKey, PathKey], ...] = ()  # (path in the expanded document, path in the file)

    def written_path(self, path: PathKey) -> PathKey:
        """Where ``path`` of the expanded document is written: an expanded node's path becomes its group's."""
        for prefix, origin in sorted(self.origins, key=lambda o: -len(o[0])):
            if path[: len(prefix)] == prefix:
                return origin + path[len(prefix) :]
        return path


def _fail(file: str, message: str, line: int | None = None, column: int | None = None) -> InvalidTopology:
    return InvalidTopology([Diagnostic(message=message, file=file, line=line, column=column)])


def read_text(path: Path, display: str) -> str:
    """Read a file as UTF-8 text with one-line errors for every way that can go wrong."""
    if not path.exists():
        raise _fail(display, "no such file")
    if path.is_dir():
        raise _fail(display, "is a directory, expected a YAML topology file")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise _fail(display, f"file is {size} bytes; a topology must be under {MAX_FILE_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise _fail(display, f"cannot read: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _fail(display, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8", line, column) from None


class _Builder:
    def __init__(self, file: str) -> None:
        self.file = file
        self.count = 0
        self.source = SourceMap()
        self.loader = yaml.SafeLoader("")

    def pos(self, node: yaml.Node) -> Position:
        return Position(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def build(self, node: yaml.Node, path: PathKey, depth: int) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise _fail(
                self.file,
                f"document expands to more than {MAX_NODES} values (YAML alias bomb?); refusing to load it",
                *self._lc(node),
            )
        if depth > MAX_DEPTH:
            raise _fail(self.file, f"nesting deeper than {MAX_DEPTH} levels; refusing to load it", *self._lc(node))
        self.source.positions.setdefault(path, self.pos(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                return self.loader.construct_object(node, deep=True)
            except yaml.YAMLError as exc:
                raise _fail(self.file, f"bad value: {getattr(exc, 'problem', exc)}", *self._lc(node)) from None
        if isinstance(node, yaml.SequenceNode):
            return [self.build(child, path + (i,), depth + 1) for i, child in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        raise _fail(self.file, f"unsupported YAML node {type(node).__name__}", *self._lc(node))

    def _mapping(self, node: yaml.MappingNode, path: PathKey, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        merged: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                # "<<: *defaults" — merged keys are overridden by explicit ones regardless of order.
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for src in sources:
                    if not isinstance(src, yaml.MappingNode):
                        raise _fail(self.file, "'<<' merge needs a mapping", *self._lc(src))
                    for k, v in self._mapping(src, path, depth + 1).items():
                        merged.setdefault(k, v)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise _fail(self.file, f"{format_path(path) or 'document'}: mapping keys must be plain strings", *self._lc(key_node))
            key = key_node.value
            if key in out:
                first = self.source.positions.get(path + (key,))
                where = f" (first at line {first.line})" if first else ""
                raise _fail(self.file, f"{format_path(path + (key,))}: duplicate key{where}; remove one of them", *self._lc(key_node))
            self.source.positions[path + (key,)] = self.pos(key_node)
            out[key] = self.build(value_node, path + (key,), depth + 1)
        for k, v in merged.items():
            out.setdefault(k, v)
        return out

    @staticmethod
    def _lc(node: yaml.Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1


def parse_yaml(text: str, display: str) -> LoadedDocument:
    """Parse one YAML document; raise InvalidTopology with line/column on any syntax problem."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if mark is not None:
            raise _fail(display, f"YAML syntax error: {problem}", mark.line + 1, mark.column + 1) from None
        raise _fail(display, f"YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise _fail(display, f"YAML error: {exc}") from None
    except RecursionError:
        raise _fail(display, f"nesting deeper than {MAX_DEPTH} levels; refusing to load it") from None
    if len(nodes) > 1:
        second = nodes[1]
        raise _fail(display, "more than one YAML document ('---'); a topology is one document", *_Builder._lc(second))
    if not nodes or nodes[0] is None:
        raise _fail(display, "file is empty; expected a topology mapping starting with 'apiVersion: bpdkv/v1'")
    builder = _Builder(display)
    data = builder.build(nodes[0], (), 0)
    return LoadedDocument(data=data, source=builder.source, file=display)


def load_yaml_file(path: Path, display: str | None = None) -> LoadedDocument:
    shown = display or str(path)
    return parse_yaml(read_text(path, shown), shown)
