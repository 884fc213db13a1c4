"""What `bpdkv validate` reports for one file: problems, a summary and the capacity figures, in three formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpdkv.errors import Diagnostic, InvalidTopology, one_line
from bpdkv.topology.capacity import instance_capacity


@dataclass(frozen=True)
class ValidationReport:
    file: str
    errors: list[Diagnostic]
    warnings: list[Diagnostic]
    summary: dict[str, Any] | None = None
    capacity: list[dict[str, Any]] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "valid": self.valid,
            "summary": self.summary,
            "capacity": self.capacity,
            "errors": [e.to_json() for e in self.errors],
            "warnings": [w.to_json() for w in self.warnings],
        }


@dataclass(frozen=True)
class ValidationRun:
    """`bpdkv validate` over several files: exit 1 when any file has an error."""

    reports: list[ValidationReport]

    @property
    def exit_code(self) -> int:
        return 0 if all(r.valid for r in self.reports) else 1


def validate_files(paths: list[str] | tuple[str, ...]) -> ValidationRun:
    return ValidationRun([validate_file(path) for path in paths])


def validate_file(path: str) -> ValidationReport:
    from bpdkv.topology.validate import load_topology

    try:
        result = load_topology(Path(path), path)
    except InvalidTopology as exc:
        return ValidationReport(path, exc.errors, exc.warnings)
    t = result.topology
    summary = {"name": t.name, "nodes": len(t.nodes), **{role: len(t.instances(role)) for role in ("prefill", "decode", "router")}}
    capacity = []
    for node, inst in t.instances():
        cap = instance_capacity(t, node, inst)
        if cap is not None:
            capacity.append({"instance": inst.name, "role": inst.role, "node": node.name, **cap.to_json()})
    return ValidationReport(path, [], result.warnings, summary, capacity)


def _escape_data(text: str) -> str:
    # GitHub workflow commands: https://docs.github.com/actions/reference/workflow-commands-for-github-actions
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotation(diagnostic: Diagnostic, fallback_file: str) -> str:
    """One `::error file=…,line=…,col=…::message` workflow command (warnings as ::warning)."""
    props = [f"file={_escape_property(diagnostic.file or fallback_file)}"]
    if diagnostic.line is not None:
        props.append(f"line={diagnostic.line}")
        if diagnostic.column is not None:
            props.append(f"col={diagnostic.column}")
    props.append("title=bpdkv validate")
    message = one_line(f"{diagnostic.path}: {diagnostic.message}" if diagnostic.path else diagnostic.message)
    kind = "warning" if diagnostic.severity == "warning" else "error"
    return f"::{kind} {','.join(props)}::{_escape_data(message)}"
