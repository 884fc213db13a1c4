"""Node groups → nodes: pure expansion of discovered machines (bpdkv.deploy.inventory finds them) into the document.

Also the placeholder machines `bpdkv validate` checks a group with, and the membership a saved plan keeps."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bpdkv.errors import BpdkvError, Diagnostic, InvalidTopology
from bpdkv.topology import schema
from bpdkv.topology.hostnames import host_problem, name_room, node_name, shown
from bpdkv.topology.partial import delete_path, parse_path
from bpdkv.topology.profiles import find_profile, list_profiles, suggest
from bpdkv.topology.yaml_source import LoadedDocument, PathKey, SourceMap, format_path

# Ansible aws_ec2 defaults, narrowed to what a node needs: SSH to the private address, name from the Name tag.
DEFAULT_HOSTNAMES = ("private-ip-address",)
DEFAULT_NAMES = ("tag:Name", "instance-id")
_ATTRIBUTES = ("private-ip-address", "ip-address", "private-dns-name", "dns-name", "instance-id")


@dataclass(frozen=True)
class Machine:
    """One discovered host. `instance_type` is None only for the placeholders `bpdkv validate` uses."""

    instance_id: str
    instance_type: str | None
    private_ip: str | None
    public_ip: str | None = None
    private_dns: str | None = None
    public_dns: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def attribute(self, key: str) -> str | None:
        """The value a `hostnames`/`names` entry (Ansible's names: private-ip-address, dns-name, tag:KEY, …) selects."""
        if key.startswith("tag:"):
            return dict(self.tags).get(key[4:]) or None
        values = {
            "private-ip-address": self.private_ip,
            "ip-address": self.public_ip,
            "private-dns-name": self.private_dns,
            "dns-name": self.public_dns,
            "instance-id": self.instance_id,
        }
        return values[key] or None


@dataclass(frozen=True)
class InventoryNode:
    """A discovered machine as a node: what `bpdkv inventory` prints."""

    name: str
    group: str
    instance_id: str
    instance_type: str
    preset: str
    host: str  # SSH address (first available `hostnames` entry)
    private_ip: str  # data-plane address
    public_ip: str | None
    dns_name: str | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Inventory:
    nodes: tuple[InventoryNode, ...]
    groups: tuple[str, ...]

    def membership(self) -> dict[str, list[str]]:
        """Instance ids per group: what a saved plan records and apply compares."""
        out: dict[str, list[str]] = {g: [] for g in self.groups}
        for node in self.nodes:
            out[node.group].append(node.instance_id)
        return {g: sorted(ids) for g, ids in out.items()}

    def to_json(self) -> dict[str, Any]:
        return {"groups": self.membership(), "nodes": [n.to_json() for n in self.nodes]}


class MembershipChanged(BpdkvError):
    """The EC2 instances a saved plan was made for are no longer the ones the groups select."""


def membership_change(saved: Mapping[str, Sequence[str]], current: Inventory) -> str | None:
    """One line naming every group whose instances differ from the saved plan's (+added -removed), or None."""
    now = current.membership()
    changes = []
    for group in sorted(set(saved) | set(now)):
        before, after = set(saved.get(group, ())), set(now.get(group, ()))
        if before != after:
            moved = [f"+{i}" for i in sorted(after - before)] + [f"-{i}" for i in sorted(before - after)]
            changes.append(f"group {group}: {' '.join(moved)}")
    if not changes:
        return None
    return f"EC2 group membership changed since the plan was saved ({'; '.join(changes)}); plan again"


def check_membership(saved: Mapping[str, Sequence[str]], current: Inventory) -> None:
    """Refuse a saved plan whose groups now select other instances."""
    change = membership_change(saved, current)
    if change:
        raise MembershipChanged(change)


def _located(source: SourceMap, path: PathKey, message: str) -> Diagnostic:
    pos = source.locate(path)
    return Diagnostic(message, format_path(path), pos.file if pos else None, pos.line if pos else None, pos.column if pos else None)


def group_problems(doc: LoadedDocument) -> list[Diagnostic]:
    """Schema problems of `node_groups` alone: discovery needs well-formed selectors before it can ask EC2 anything."""
    groups = doc.data.get("node_groups")
    if not isinstance(groups, list):
        return [_located(doc.source, ("node_groups",), "expected a list of node groups")]
    out: list[Diagnostic] = []
    for gi, group in enumerate(groups):
        prefix: PathKey = ("node_groups", gi)
        sub = SourceMap({p[2:]: pos for p, pos in doc.source.positions.items() if p[:2] == prefix})
        for d in schema.validate(group, sub, "nodeGroup"):
            path = format_path(prefix) + (("." + d.path) if d.path and not d.path.startswith("[") else d.path)
            out.append(dataclasses.replace(d, path=path))
    names = [g.get("name") for g in groups if isinstance(g, dict)]
    for gi, name in enumerate(names):
        if name in names[:gi]:
            out.append(_located(doc.source, ("node_groups", gi, "name"), f"group name '{name}' is used twice; names must be unique"))
    return out


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def dns_label(text: str) -> str:
    """A tag value as a node name: lowercase letters, digits and '-', at most 63 characters."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return label[:63].rstrip("-")


def _pick(machine: Machine, preferences: Sequence[str]) -> tuple[str, str] | None:
    """(the preference that answered, its value): the first available one."""
    for key in preferences:
        value = machine.attribute(key)
        if value:
            return key, value
    return None


def expand_groups(doc: LoadedDocument, machines: Mapping[str, Sequence[Machine]]) -> tuple[LoadedDocument, Inventory]:
    """Append one node per discovered machine to `nodes` (after the written ones), each with its group's layout.

    Node names come from the group's `names` preference (made DNS-safe), instance names are prefixed with the node
    name so they stay unique and stable when machines come and go. Every problem is reported at once."""
    problems = group_problems(doc)
    if problems:
        raise InvalidTopology(problems)
    expanded, inventory, errors = _expand(doc, machines)
    if errors:
        raise InvalidTopology(errors)
    return expanded, inventory


def _expand(doc: LoadedDocument, machines: Mapping[str, Sequence[Machine]]) -> tuple[LoadedDocument, Inventory, list[Diagnostic]]:
    """expand_groups of schema-valid groups: the machines that make a node, and the problems of those that do not."""
    data = dict(doc.data)
    if not isinstance(data.get("nodes", []), list):
        raise InvalidTopology([_located(doc.source, ("nodes",), "expected a list of nodes")])
    nodes = list(data.get("nodes") or [])
    source = SourceMap(dict(doc.source.positions))
    errors: list[Diagnostic] = []
    found: list[InventoryNode] = []
    owner: dict[str, str] = {}
    names_taken: dict[str, str] = {}
    group_names: list[str] = []
    presets = [p.name for p in list_profiles("hardware")]
    for gi, group in enumerate(data["node_groups"]):
        gname = group["name"]
        group_names.append(gname)
        where: PathKey = ("node_groups", gi)
        ec2 = group["ec2"]
        hostnames = ec2.get("hostnames", list(DEFAULT_HOSTNAMES))
        name_prefs = list(ec2.get("names", list(DEFAULT_NAMES)))
        if "instance-id" not in name_prefs:
            name_prefs.append("instance-id")  # always a name, even when every tag is missing
        selected = machines.get(gname, ())
        if not selected:
            errors.append(_located(doc.source, where + ("ec2", "filters"), "matched no running EC2 instance; check the filters and region"))
        expected = group.get("instance_type")
        rows = []
        room = name_room(group["instances"])
        for m in selected:
            key, value = next(((k, v) for k in name_prefs if (v := m.attribute(k)) and dns_label(v)), ("instance-id", m.instance_id))
            rows.append((node_name(value, room), m, f"{key} = {shown(value)}"))
        for label, m, named in sorted(rows, key=lambda r: (r[0], r[1].instance_id)):
            what = f"instance {m.instance_id} ({label})"
            if not label:  # a name that cannot fit beside the layout's instance names (see name_room)
                errors.append(
                    _located(
                        doc.source,
                        where + ("instances",),
                        f"instance {m.instance_id}: {named} cannot become a node name: the layout's instance names leave "
                        f"{max(room, 0)} of 63 characters for it (at least 10 needed); shorten the instance names",
                    )
                )
                continue
            if m.instance_id in owner:
                errors.append(_located(doc.source, where + ("ec2", "filters"), f"{what} is also selected by group {owner[m.instance_id]}"))
                continue
            owner[m.instance_id] = gname
            if m.instance_type is not None and expected and m.instance_type != expected:
                errors.append(
                    _located(
                        doc.source,
                        where + ("instance_type",),
                        f"{what} is {m.instance_type}, the group expects {expected}; narrow the filters (e.g. instance-type)",
                    )
                )
                continue
            if m.instance_type is not None and find_profile("hardware", m.instance_type) is None:
                errors.append(
                    _located(
                        doc.source,
                        where + ("ec2",),
                        f"{what}: no hardware preset for instance type '{m.instance_type}'; "
                        f"add profiles/hardware/{m.instance_type}.yaml or narrow the filters ({suggest(m.instance_type, presets)})",
                    )
                )
                continue
            picked = _pick(m, hostnames)
            if not m.private_ip:
                errors.append(_located(doc.source, where + ("ec2",), f"{what} has no private IP address (the data-plane address)"))
                continue
            if not _is_ip(m.private_ip):
                errors.append(
                    _located(doc.source, where + ("ec2",), f"{what}: EC2 answered private IP {shown(m.private_ip)}, not an IP address")
                )
                continue
            if picked is None:
                errors.append(_located(doc.source, where + ("ec2", "hostnames"), f"{what} has none of hostnames {', '.join(hostnames)}"))
                continue
            key, host = picked
            problem = host_problem(host)
            if problem:
                # A tag value is set by whoever may tag instances: it never reaches a command line unless it is a host.
                errors.append(_located(doc.source, where + ("ec2", "hostnames"), f"{what}: {key} = {shown(host)} {problem}"))
                continue
            if label in names_taken:
                errors.append(
                    _located(
                        doc.source,
                        where + ("ec2", "names"),
                        f"{what} and instance {names_taken[label]} both make node name '{label}'; tag them uniquely or use names: [instance-id]",
                    )
                )
                continue
            names_taken[label] = m.instance_id
            k = len(nodes)
            node = _node(group, label, host, m)
            nodes.append(node)
            for path, pos in doc.source.positions.items():
                if path[:2] == where:
                    source.positions[("nodes", k) + path[2:]] = pos
            found.append(
                InventoryNode(
                    name=label,
                    group=gname,
                    instance_id=m.instance_id,
                    instance_type=m.instance_type or "",
                    preset=m.instance_type or "",
                    host=host,
                    private_ip=m.private_ip,
                    public_ip=m.public_ip,
                    dns_name=m.public_dns or m.private_dns,
                )
            )
    errors.sort(key=lambda d: (d.line or 0, d.column or 0))
    data["nodes"] = nodes
    return LoadedDocument(data, source, doc.file), Inventory(tuple(found), tuple(group_names)), errors


def _node(group: dict[str, Any], name: str, host: str, machine: Machine) -> dict[str, Any]:
    instances = []
    per_role: dict[str, int] = {}
    for layout in group["instances"]:
        inst = copy.deepcopy(layout)
        k = per_role.get(inst["role"], 0)
        per_role[inst["role"]] = k + 1
        inst["name"] = f"{name}-{inst['name']}" if "name" in inst else f"{name}-{inst['role']}-{k}"
        instances.append(inst)
    node: dict[str, Any] = {"name": name, "host": host, "data_plane_address": machine.private_ip, "instances": instances}
    if machine.instance_type is not None:
        node["hardware"] = machine.instance_type
    else:
        # `validate` without EC2 and without instance_type: give the placeholder the GPUs its layout asks for.
        node["gpus"] = max((g + 1 for i in instances for g in i.get("gpus", [])), default=0)
    for key in ("env", "ssh"):
        if key in group:
            node[key] = copy.deepcopy(group[key])
    return node


def placeholder_machines(doc: LoadedDocument) -> dict[str, list[Machine]]:
    """One documentation-range machine per group, with every attribute the group's preferences ask for."""
    out: dict[str, list[Machine]] = {}
    for gi, group in enumerate(doc.data["node_groups"]):
        ec2 = group["ec2"]
        keys = list(ec2.get("hostnames", DEFAULT_HOSTNAMES)) + list(ec2.get("names", DEFAULT_NAMES))
        tags = tuple((k[4:], f"{group['name']}-example") for k in keys if k.startswith("tag:"))
        out[group["name"]] = [
            Machine(
                instance_id=f"i-{gi:017x}",
                instance_type=group.get("instance_type"),
                private_ip=f"192.0.2.{10 + gi % 240}",  # RFC 5737 documentation addresses: never a real host
                public_ip=f"198.51.100.{10 + gi % 240}",
                private_dns=f"{group['name']}.example.invalid",
                public_dns=f"{group['name']}.public.example.invalid",
                tags=tags,
            )
        ]
    return out


@dataclass(frozen=True)
class UsableGroups:
    """Node groups cut down to what passed the schema, so `bpdkv validate` checks the rest in the same run."""

    doc: LoadedDocument  # the document with only the usable groups and layout instances, positions kept
    problems: list[Diagnostic]  # the groups' schema problems (and unknown instance types), at their written paths
    set_aside: set[PathKey]  # written paths of the parts left out
    origins: dict[PathKey, PathKey]  # (node_groups, kept index[, instances, kept index]) -> its written path


def usable_groups(doc: LoadedDocument) -> UsableGroups:
    """Set aside only the parts of `node_groups` that fail the schema: a layout instance, or a setting the group is
    then checked without (a misspelt `hostnames` value: the default; an instance type with no preset: a machine with
    the GPUs its layout asks for). A whole group goes only when it has no usable layout left."""
    problems = group_problems(doc)
    groups = doc.data.get("node_groups")
    data = dict(doc.data, node_groups=[])
    if not isinstance(groups, list):
        return UsableGroups(LoadedDocument(data, doc.source, doc.file), problems, {("node_groups",)}, {})
    broken: dict[int, list[PathKey]] = {}
    for problem in problems:
        path = parse_path(problem.path)
        if len(path) >= 2 and isinstance(path[1], int):
            broken.setdefault(path[1], []).append(path[2:])
    set_aside: set[PathKey] = set()
    origins: dict[PathKey, PathKey] = {}
    positions = {p: pos for p, pos in doc.source.positions.items() if p[:1] != ("node_groups",) or len(p) == 1}
    presets = [p.name for p in list_profiles("hardware")]
    names: set[str] = set()
    for gi, written in enumerate(groups):
        where: PathKey = ("node_groups", gi)
        rels = broken.get(gi, [])
        if not isinstance(written, dict) or not isinstance(written.get("instances"), list) or ("instances",) in rels:
            set_aside.add(where)
            continue
        group = copy.deepcopy(written)
        unknown = {issue.path for issue in schema.issues(written, "nodeGroup") if issue.unknown_key}
        for rel in unknown:  # bpdkv would ignore nothing else about its part: drop the key alone
            delete_path(group, rel)
        rels = [rel for rel in rels if rel not in unknown]
        bad_layout = {rel[1] for rel in rels if len(rel) >= 2 and rel[0] == "instances" and isinstance(rel[1], int)}
        set_aside.update(where + ("instances", j) for j in bad_layout)
        if not isinstance(group.get("ec2"), dict):
            group["ec2"] = {}
            set_aside.add(where + ("ec2",))
        for rel in rels:
            if rel[:1] == ("ec2",) and len(rel) >= 2:
                group["ec2"].pop(rel[1], None)
                set_aside.add(where + rel[:2])
            elif rel and rel[0] not in ("instances", "ec2", "name"):
                group.pop(rel[0], None)
                set_aside.add(where + rel[:1])
        name = group.get("name")
        if not isinstance(name, str) or any(rel[:1] == ("name",) for rel in rels) or name in names:
            name = (dns_label(name) if isinstance(name, str) else "") or f"group-{gi}"
            name = name if name not in names else f"{name}-{gi}"
            set_aside.add(where + ("name",))
        names.add(name)
        group["name"] = name
        itype = group.get("instance_type")
        if isinstance(itype, str) and find_profile("hardware", itype) is None:
            problems.append(
                _located(
                    doc.source,
                    where + ("instance_type",),
                    f"no hardware preset for instance type '{itype}'; add profiles/hardware/{itype}.yaml ({suggest(itype, presets)})",
                )
            )
            group.pop("instance_type")
            set_aside.add(where + ("instance_type",))
        layout = [j for j in range(len(group["instances"])) if j not in bad_layout]
        if not layout:
            set_aside.add(where)
            continue
        group["instances"] = [group["instances"][j] for j in layout]
        kept: PathKey = ("node_groups", len(data["node_groups"]))
        data["node_groups"].append(group)
        origins[kept] = where
        for new_j, j in enumerate(layout):
            origins[kept + ("instances", new_j)] = where + ("instances", j)
        for path, pos in doc.source.positions.items():
            if path[:2] != where:
                continue
            rest = path[2:]
            if rest[:1] == ("instances",) and len(rest) >= 2:
                if rest[1] not in layout:
                    continue
                rest = ("instances", layout.index(int(rest[1]))) + rest[2:]
            positions[kept + rest] = pos
    problems.sort(key=lambda d: (d.line or 0, d.column or 0))
    return UsableGroups(LoadedDocument(data, SourceMap(positions), doc.file), problems, set_aside, origins)


def _written(path: PathKey, origins: Mapping[PathKey, PathKey]) -> PathKey:
    for prefix, origin in sorted(origins.items(), key=lambda o: -len(o[0])):
        if path[: len(prefix)] == prefix:
            return origin + path[len(prefix) :]
    return path


def offline_inventory(doc: LoadedDocument) -> LoadedDocument:
    """For `bpdkv validate`: each group as one placeholder machine, so its layout is checked without asking EC2.

    A group's schema-invalid parts are set aside (usable_groups) and carried as problems in the document, so the
    other groups, the written nodes and the rest of the group are still checked in the same run."""
    usable = usable_groups(doc)
    expanded, inventory, errors = _expand(usable.doc, placeholder_machines(usable.doc))
    problems = list(usable.problems)
    set_aside = set(usable.set_aside)
    for error in errors:  # a placeholder that could not become a node: its group is left out
        where = _written(parse_path(error.path), usable.origins)
        problems.append(dataclasses.replace(error, path=format_path(where)))
        set_aside.add(where[:2])
    origins = dict(usable.origins)
    first = len(expanded.data["nodes"]) - len(inventory.nodes)
    kept = {g["name"]: ("node_groups", gi) for gi, g in enumerate(usable.doc.data["node_groups"])}
    for k, node in enumerate(inventory.nodes, start=first):
        origins[("nodes", k)] = origins[kept[node.group]]
        for j in range(len(expanded.data["nodes"][k]["instances"])):
            origins[("nodes", k, "instances", j)] = origins[kept[node.group] + ("instances", j)]
    untyped = {g["name"] for g in usable.doc.data["node_groups"] if "instance_type" not in g}
    if set_aside:  # the groups' problems are said; what stood in for their bad parts is not for the schema to judge
        expanded.data = {key: value for key, value in expanded.data.items() if key != "node_groups"}
    return dataclasses.replace(
        expanded,
        unknown_hardware=frozenset(n.name for n in inventory.nodes if n.group in untyped),
        problems=tuple(problems),
        set_aside={path: doc.source.locate(path) for path in set_aside},
        origins=tuple((k, v) for k, v in origins.items() if k[0] == "nodes"),
    )
