"""The front of the pipeline: file → YAML → profiles merged → schema → model → checks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpdkv.errors import Diagnostic, InvalidTopology
from bpdkv.topology import checks, schema
from bpdkv.topology.model import Topology, build_topology
from bpdkv.topology.partial import parse_path, valid_parts
from bpdkv.topology.profiles import find_profile, list_profiles, load_profile, suggest
from bpdkv.topology.yaml_source import LoadedDocument, PathKey, Position, SourceMap, format_path, load_yaml_file

# Keys a hardware preset may fill on a node; everything else in the preset is documentation.
HARDWARE_NODE_KEYS = ("accelerator", "gpus", "gpu_model", "gpu_memory_gib", "host_memory_gib", "efa_devices", "env")


@dataclass(frozen=True)
class ValidatedTopology:
    topology: Topology
    warnings: list[Diagnostic]
    file: str


def deep_merge(base: Any, override: Any) -> Any:
    """Mappings merge key by key; anything else (lists included) is replaced by the override."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = deep_merge(base[key], value) if key in base else value
        return out
    return copy.deepcopy(override)


def _diag(source: SourceMap, path: PathKey, message: str, severity: str = "error", doc: LoadedDocument | None = None) -> Diagnostic:
    """Located by ``path``; named by where it is written (an expanded node's problem names its group's part)."""
    pos = source.locate(path)
    return Diagnostic(
        message=message,
        path=format_path(doc.written_path(path) if doc else path),
        file=pos.file if pos else None,
        line=pos.line if pos else None,
        column=pos.column if pos else None,
        severity=severity,
    )


def _rebase(source: SourceMap, prefix: PathKey, skip_root: bool = True) -> SourceMap:
    out = SourceMap()
    for path, pos in source.positions.items():
        if skip_root and not path:
            continue
        out.positions[prefix + path] = pos
    return out


def _load_preset(
    kind: str, name: Any, where: PathKey, doc: LoadedDocument, definition: str, errors: list[Diagnostic]
) -> LoadedDocument | None:
    if not isinstance(name, str):
        return None  # the schema reports the wrong type
    ref = find_profile(kind, name)
    if ref is None:
        what = "model profile" if kind == "models" else "hardware preset"
        names = [p.name for p in list_profiles(kind)]
        errors.append(_diag(doc.source, where, f"unknown {what} '{name}'; {suggest(name, names)}"))
        return None
    try:
        preset = load_profile(ref)
    except InvalidTopology as exc:
        errors.extend(exc.errors)
        return None
    preset_errors = schema.validate(preset.data, preset.source, definition)
    if preset_errors:
        errors.extend(preset_errors)
        return None
    return preset


def merge_presets(doc: LoadedDocument) -> tuple[Any, SourceMap, list[Diagnostic]]:
    """Profiles fill defaults; the topology overrides them. Positions follow the value's origin."""
    errors: list[Diagnostic] = []
    data = doc.data
    if not isinstance(data, dict):
        return data, doc.source, errors
    merged: dict[str, Any] = data
    source = SourceMap()
    if "profile" in data:
        preset = _load_preset("models", data["profile"], ("profile",), doc, "modelProfile", errors)
        if preset is not None:
            layer = {k: v for k, v in preset.data.items() if k != "description"}
            merged = deep_merge(layer, data)
            source.overlay(_rebase(preset.source, ()))
    nodes = merged.get("nodes")
    if isinstance(nodes, list):
        new_nodes = []
        for ni, node in enumerate(nodes):
            if isinstance(node, dict) and "hardware" in node:
                preset = _load_preset("hardware", node["hardware"], ("nodes", ni, "hardware"), doc, "hardwareProfile", errors)
                if preset is not None:
                    layer = {k: v for k, v in preset.data.items() if k in HARDWARE_NODE_KEYS}
                    node = deep_merge(layer, node)
                    source.overlay(_rebase(preset.source, ("nodes", ni)))
            new_nodes.append(node)
        merged = dict(merged, nodes=new_nodes)
    source.overlay(doc.source)  # the topology's own positions win
    return merged, source, errors


# Resolves `node_groups` into `nodes` (bpdkv.deploy.inventory): injected, so the topology side stays free of network access.
Inventory = Callable[[LoadedDocument], LoadedDocument]


def validate_document(doc: LoadedDocument, inventory: Inventory | None = None) -> ValidatedTopology:
    if not isinstance(doc.data, dict):
        kind = type(doc.data).__name__
        raise InvalidTopology(
            [Diagnostic(f"top level must be a mapping (apiVersion, name, model, nodes, ...), got {kind}", file=doc.file, line=1, column=1)]
        )
    offline: list[Diagnostic] = []
    if "node_groups" in doc.data:
        if inventory is None:
            # No discovery here (validate, render): each group is checked as one placeholder machine, and said so.
            from bpdkv.topology.groups import offline_inventory

            inventory = offline_inventory
            offline.append(
                _diag(
                    doc.source,
                    ("node_groups",),
                    "checked with one placeholder machine per group, EC2 not asked; `bpdkv inventory`, `plan` and `apply` ask it",
                    "warning",
                )
            )
        doc = inventory(doc)
    merged, source, errors = merge_presets(doc)
    if doc.unknown_hardware:
        merged = _assume_needed_hardware(merged, doc.unknown_hardware)
    errors = list(doc.problems) + errors + schema.validate(merged, source)
    if errors:
        errors, warnings = _with_problems_of_valid_parts(merged, source, errors, doc)
        raise InvalidTopology(errors, offline + warnings)
    topology = build_topology(merged)
    problems = checks.run_checks(topology)
    errors = [_diag(source, p.path, p.message, doc=doc) for p in problems if p.severity == "error"]
    warnings = offline + [_diag(source, p.path, p.message, "warning", doc) for p in problems if p.severity == "warning"]
    errors.sort(key=lambda d: (d.line or 0, d.column or 0))
    if errors:
        raise InvalidTopology(errors, warnings)
    return ValidatedTopology(topology=topology, warnings=warnings, file=doc.file)


def _assume_needed_hardware(merged: Any, names: frozenset[str]) -> Any:
    """A placeholder of a group without instance_type has the GPUs its layout asks for (groups.py) and, in a fleet whose
    KV moves over LIBFABRIC (written, or implied by another node's EFA), EFA too: inventory checks the real machines'
    presets, so validate and plan --offline must not refuse what they would accept (nor accept less)."""
    if not isinstance(merged, dict) or not isinstance(merged.get("nodes"), list):
        return merged
    nodes = merged["nodes"]
    kv: dict[str, Any] = merged["kv_transfer"] if isinstance(merged.get("kv_transfer"), dict) else {}

    def placeholder(n: Any) -> bool:
        return isinstance(n, dict) and isinstance(n.get("name"), str) and n["name"] in names

    efa_elsewhere = any(isinstance(n, dict) and not placeholder(n) and _positive(n.get("efa_devices")) for n in nodes)
    if kv.get("backend", "LIBFABRIC" if efa_elsewhere else "UCX") != "LIBFABRIC":
        return merged
    fixed = [dict(n, efa_devices=1) if placeholder(n) and "efa_devices" not in n else n for n in nodes]
    return dict(merged, nodes=fixed)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


SKIPPED_ALL = "semantic checks skipped: no node with a valid instance is left once the schema errors are set aside; fix them first"


_INSTANCE_SKIPPED = "instance not checked further until its errors are fixed: its GPU, port, P/D and capacity checks were skipped"


def skipped_checks(path: PathKey) -> str:
    """The warning for a part left out of the semantic checks because it fails the schema: which checks, and why."""
    kind, rest = path[0], path[2:]
    if kind == "nodes" and len(path) == 2:
        return "node not checked further until its errors are fixed: its address, SSH, EFA and instance checks were skipped"
    if kind in ("nodes", "node_groups") and len(rest) == 2 and rest[0] == "instances":
        return _INSTANCE_SKIPPED
    if kind == "nodes" and rest == ("instances",):
        return "the node's instances not checked until its errors are fixed: their GPU, port, P/D and capacity checks were skipped"
    if kind == "nodes" and rest == ("name",):
        return "the rest of the node was checked; messages name it as written, or by its place without a name"
    if kind == "nodes" and len(rest) == 3 and rest[2] == "name":
        return "the rest of the instance was checked, its messages name it as written"
    if kind == "nodes" and rest == ("host",):
        return "not checked further until its errors are fixed; the rest of the node was checked"
    if kind == "node_groups" and len(path) <= 2:
        return "group not checked further until its errors are fixed: its layout's GPU, port, P/D and capacity checks were skipped"
    if kind == "node_groups" and rest == ("instance_type",):
        return "the group was checked as a machine with the GPUs its layout asks for, as without instance_type"
    if kind == "node_groups" and rest == ("name",):
        return "the group was checked under a placeholder name"
    return "invalid: the semantic checks ran with its default instead"


def _with_problems_of_valid_parts(
    merged: Any, source: SourceMap, errors: list[Diagnostic], doc: LoadedDocument
) -> tuple[list[Diagnostic], list[Diagnostic]]:
    """Schema errors plus the semantic problems of every part that passed the schema: all problems in one run."""
    errors, warnings = list(errors), list[Diagnostic]()
    file = doc.file
    unknown_keys = [issue.path for issue in schema.issues(merged) if issue.unknown_key]
    parts = valid_parts(merged, errors, unknown_keys, frozenset(doc.set_aside))
    # What is left must pass the schema (the model is built from it), but for the placeholders that stand in for it.
    leftover = parts and [d for d in schema.validate(parts.data, source) if not parts.explains(parts.original(parse_path(d.path)))]
    if parts is None or leftover:
        warnings.append(Diagnostic(SKIPPED_ALL, file=file, severity="warning"))
    else:
        for problem in checks.run_checks(build_topology(parts.data)):
            path = parts.original(problem.path)
            if not parts.explains(path):
                (errors if problem.severity == "error" else warnings).append(_diag(source, path, problem.message, problem.severity, doc))
        for path in sorted(parts.dropped, key=str):
            located = SourceMap({path: pos}) if (pos := doc.set_aside.get(path)) else source  # a group's part: as written
            warnings.append(_diag(located, path, skipped_checks(path), "warning"))
    warnings.sort(key=lambda d: (d.file != file, d.line or 0, d.column or 0))
    errors.sort(key=lambda d: (d.file != file, d.line or 0, d.column or 0))
    return errors, warnings


def load_topology(path: Path | str, display: str | None = None, inventory: Inventory | None = None) -> ValidatedTopology:
    """Load and validate a topology file; raise InvalidTopology listing every problem."""
    p = Path(path)
    return validate_document(load_yaml_file(p, display or str(path)), inventory)


__all__ = ["Position", "ValidatedTopology", "load_topology", "validate_document", "deep_merge"]
