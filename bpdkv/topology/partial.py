"""Keep the parts of a document that passed the schema, so semantic checks run on them in the same run.

A schema error in one instance must not hide a port collision or a missing GPU elsewhere. The parts are: each
instance, each node's own keys, the node's hardware, and each top-level section's keys. An unknown key is simply
dropped (bpdkv would ignore nothing else about its part); any other problem drops the smallest part holding it: the
instance; a node's name or host (a placeholder stands in, so the node's other checks still run), its address, env or
SSH key (the default applies); the node's instances when its hardware is unknown (their GPUs cannot be checked, its
address still is); or the section's key (its default applies). Node groups arrive expanded with their bad parts
already set aside (bpdkv.topology.groups.usable_groups). Semantic problems about what was dropped, or that a dropped
part could explain (e.g. "no decode instance" when a decode instance failed the schema), are not reported.
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


# A node's own keys: a bad one is replaced (name, host: a placeholder; the others: their default) and the node's other
# checks still run. Any other key of a node describes its hardware: a bad one leaves its instances unchecked.
_NODE_OWN = ("name", "host", "data_plane_address", "env", "ssh")


@dataclass
class ValidParts:
    """The document cut down to its schema-valid parts, and how to map paths back to the original document."""

    data: dict[str, Any]
    node_index: list[int]  # new node index -> original index
    instance_index: dict[tuple[int, int], int]  # (original node, new instance) -> original instance
    dropped: set[PathKey] = field(default_factory=set)  # original paths of removed parts
    lost_instances: bool = False  # an instance (or a node's, or a group's) was left out

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
        if path == ("nodes",) and self.lost_instances:
            return True  # roles_present: the missing role may be in a dropped instance
        return any(path[: len(d)] == d for d in self.dropped)


def delete_path(data: Any, path: PathKey) -> None:
    for key in path[:-1]:
        if isinstance(data, dict) and isinstance(key, str) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return
    if isinstance(data, dict) and path and path[-1] in data:
        del data[path[-1]]


def _stand_in(node: dict[str, Any], key: str, ni: int) -> None:
    """A placeholder for a node's bad or missing name or host: the written name when it is text (messages then name
    the node as the user does), else its place in the file; a host no check objects to."""
    if key == "name":
        node["name"] = node["name"] if isinstance(node.get("name"), str) and node["name"] else f"nodes[{ni}]"
    else:
        node["host"] = f"node-{ni}.invalid"  # RFC 2606: never a real host


def valid_parts(
    merged: Any, errors: list[Diagnostic], unknown_keys: list[PathKey], set_aside: frozenset[PathKey] = frozenset()
) -> ValidParts | None:
    """The schema-valid parts of ``merged`` given its schema/preset ``errors`` (of which ``unknown_keys`` only name a
    key to drop) and the node-group parts already ``set_aside``; None when nothing checkable is left."""
    if not isinstance(merged, dict) or not isinstance(merged.get("nodes"), list):
        return None
    data = copy.deepcopy(merged)
    dropped: set[PathKey] = set(set_aside)
    lost = any(len(p) <= 2 or p[2] == "instances" for p in set_aside)
    unchecked_hardware: set[int] = set()
    broken_instances: set[tuple[int, int]] = set()
    for key_path in unknown_keys:
        delete_path(data, key_path)
    for error in errors:
        path = parse_path(error.path)
        if path in unknown_keys or path[:1] == ("node_groups",):
            continue  # node groups: set aside before they were expanded
        if not path:
            for key, placeholder in _PLACEHOLDERS.items():
                data.setdefault(key, copy.deepcopy(placeholder))
            continue
        if path[0] == "nodes":
            if len(path) < 2 or not isinstance(path[1], int):
                return None
            ni = path[1]
            node = data["nodes"][ni] if ni < len(data["nodes"]) else None
            if not isinstance(node, dict):
                continue  # left out whole below
            if len(path) >= 4 and path[2] == "instances" and isinstance(path[3], int):
                instance = node["instances"][path[3]] if isinstance(node.get("instances"), list) else None
                if path[4:5] == ("name",) and isinstance(instance, dict) and isinstance(instance.get("name"), str):
                    dropped.add(path[:5])  # checked under the name as written
                else:
                    broken_instances.add((ni, path[3]))
                    dropped.add(path[:4])
            elif len(path) == 2:  # a required key is missing
                for key in ("name", "host"):
                    if key not in node:
                        _stand_in(node, key, ni)
                        dropped.add(path + (key,))
                if not isinstance(node.get("instances"), list):
                    unchecked_hardware.add(ni)
            elif path[2] in ("name", "host"):
                _stand_in(node, str(path[2]), ni)
                dropped.add(path[:3])
            elif path[2] in _NODE_OWN:
                cut = path[:4] if path[2] == "ssh" and len(path) >= 4 else path[:3]
                delete_path(data, cut)
                dropped.add(cut)
            else:  # its hardware (or its instances list): what its instances would run on is unknown
                if path[2] != "instances":
                    delete_path(data, path[:3])
                unchecked_hardware.add(ni)
            continue
        section = str(path[0])
        if len(path) == 1 or not isinstance(data.get(section), dict):
            data[section] = copy.deepcopy(_PLACEHOLDERS.get(section, {}))
            dropped.add(path[:1])
        else:
            delete_path(data, path[:2])
            dropped.add(path[:2])
    if isinstance(data.get("model"), dict):
        data["model"].setdefault("id", _PLACEHOLDERS["model"]["id"])
    nodes: list[Any] = []
    node_index: list[int] = []
    instance_index: dict[tuple[int, int], int] = {}
    for ni, node in enumerate(data["nodes"]):
        if not isinstance(node, dict):
            dropped.add(("nodes", ni))
            lost = True
            continue
        written = node.get("instances") if ni not in unchecked_hardware else None
        kept = [(ii, inst) for ii, inst in enumerate(written or []) if (ni, ii) not in broken_instances]
        if not kept and not any(n == ni for n, _ in broken_instances):  # its address and SSH are still checked
            dropped.add(("nodes", ni, "instances"))
            lost = True
        for new_ii, (ii, _) in enumerate(kept):
            instance_index[(ni, new_ii)] = ii
        nodes.append(dict(node, instances=[inst for _, inst in kept]))
        node_index.append(ni)
    if not nodes:
        return None
    data["nodes"] = nodes
    lost = lost or bool(broken_instances)
    return ValidParts(data=data, node_index=node_index, instance_index=instance_index, dropped=dropped, lost_instances=lost)
