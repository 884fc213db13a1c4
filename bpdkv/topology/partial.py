"""Keep the parts of a document that passed the schema, so semantic checks run on them in the same run.

A schema error in one instance must not hide a port collision or a missing GPU elsewhere. The parts are: each
instance, each node (its own keys), and each top-level section's keys. An unknown key is simply dropped (bpdkv would
ignore nothing else about its part); any other problem drops the smallest part holding it: the instance, the node,
or the section's key (its default applies). Semantic problems about what was dropped, or that a dropped part could
explain (e.g. "no decode instance" when a decode instance failed the schema), are not reported.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from bpdkv.errors import Diagnostic
from bpdkv.topology.yaml_source import PathKey

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
# Placeholders for required top-level keys, so checks that do not use them still run.
_PLACEHOLDERS: dict[str, Any] = {"apiVersion": "bpdkv/v1", "name": "invalid", "model": {"id": "<invalid model>"}}


def parse_path(text: str) -> PathKey:
    """Inverse of load.format_path: "nodes[1].instances[0].gpus" -> ("nodes", 1, "instances", 0, "gpus")."""
    return tuple(int(index) if index else key for key, index in _PART.findall(text))


@dataclass
class ValidParts:
    """The document cut down to its schema-valid parts, and how to map paths back to the original document."""

    data: dict[str, Any]
    node_index: list[int]  # new node index -> original index
    instance_index: dict[tuple[int, int], int]  # (original node, new instance) -> original instance
    dropped: set[PathKey] = field(default_factory=set)  # original paths of removed parts

    def original(self, path: PathKey) -> PathKey:
        if len(path) < 2 or path[0] != "nodes" or not isinstance(path[1], int):
            return path
        node = self.node_index[path[1]]
        out: tuple[str | int, ...] = ("nodes", node) + path[2:]
        if len(path) >= 4 and path[2] == "instances" and isinstance(path[3], int):
            out = ("nodes", node, "instances", self.instance_index[(node, path[3])]) + path[4:]
        return out

    def explains(self, path: PathKey) -> bool:
        """Whether a semantic problem at (original) ``path`` may only be a consequence of a dropped part."""
        if path == ("nodes",) and self.dropped:
            return True  # roles_present: the missing role may be in a dropped instance
        return any(path[: len(d)] == d for d in self.dropped)


def _delete(data: Any, path: PathKey) -> None:
    for key in path[:-1]:
        if isinstance(data, dict) and isinstance(key, str) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return
    if isinstance(data, dict) and path and path[-1] in data:
        del data[path[-1]]


def valid_parts(merged: Any, errors: list[Diagnostic], unknown_keys: list[PathKey]) -> ValidParts | None:
    """The schema-valid parts of ``merged`` given its schema/preset ``errors`` (of which ``unknown_keys`` only name a
    key to drop); None when nothing checkable is left."""
    if not isinstance(merged, dict) or not isinstance(merged.get("nodes"), list):
        return None
    data = copy.deepcopy(merged)
    dropped: set[PathKey] = set()
    broken_nodes: set[int] = set()
    broken_instances: set[tuple[int, int]] = set()
    for key_path in unknown_keys:
        _delete(data, key_path)
    for error in errors:
        path = parse_path(error.path)
        if path in unknown_keys:
            continue
        if not path:
            for key, placeholder in _PLACEHOLDERS.items():
                data.setdefault(key, copy.deepcopy(placeholder))
            continue
        if path[0] == "nodes":
            if len(path) < 2 or not isinstance(path[1], int):
                return None
            if len(path) >= 4 and path[2] == "instances" and isinstance(path[3], int):
                broken_instances.add((path[1], path[3]))
                dropped.add(path[:4])
            else:
                broken_nodes.add(path[1])
                dropped.add(path[:2])
            continue
        section = str(path[0])
        if len(path) == 1 or not isinstance(data.get(section), dict):
            data[section] = copy.deepcopy(_PLACEHOLDERS.get(section, {}))
            dropped.add(path[:1])
        else:
            _delete(data, path[:2])
            dropped.add(path[:2])
    if isinstance(data.get("model"), dict):
        data["model"].setdefault("id", _PLACEHOLDERS["model"]["id"])
    nodes: list[Any] = []
    node_index: list[int] = []
    instance_index: dict[tuple[int, int], int] = {}
    for ni, node in enumerate(data["nodes"]):
        if ni in broken_nodes or not isinstance(node, dict) or not isinstance(node.get("instances"), list):
            continue
        kept = [(ii, inst) for ii, inst in enumerate(node["instances"]) if (ni, ii) not in broken_instances]
        if not kept:
            dropped.add(("nodes", ni))
            continue
        for new_ii, (ii, _) in enumerate(kept):
            instance_index[(ni, new_ii)] = ii
        nodes.append(dict(node, instances=[inst for _, inst in kept]))
        node_index.append(ni)
    if not nodes:
        return None
    data["nodes"] = nodes
    return ValidParts(data=data, node_index=node_index, instance_index=instance_index, dropped=dropped)
