"""The offline commands' workflows (render into a folder, scaffold a topology) as library calls: the CLI parses,
calls one, prints what it returns and exits. The fleet's commands live behind bpdkv.deploy.fleet."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpdkv.errors import UsageError


@dataclass(frozen=True)
class Rendered:
    files: int
    hosts: list[str]
    out_dir: Path
    monitoring: Path
    warnings: list[Any]

    def lines(self) -> list[str]:
        return [
            f"rendered {self.files} file(s) for {len(self.hosts)} host(s) into {self.out_dir}/ ({', '.join(self.hosts)})",
            f"monitoring for your own machine (not a node): {self.monitoring}/prometheus.yml, {self.monitoring}/grafana-dashboard.json",
        ]


def render_folder(topology: str, out_dir: Path, include_secrets: bool) -> Rendered:
    """`bpdkv render`: one sub-folder per host, plus the operator's monitoring files; nothing written when invalid."""
    from bpdkv.observability import OUT_DIR, observability_files
    from bpdkv.render import render_topology, write_artifacts
    from bpdkv.topology.validate import load_topology

    result = load_topology(Path(topology), topology)  # raises before anything is written
    model = result.topology
    if include_secrets:
        from bpdkv.secret_refs import Resolver, resolve_topology

        model = resolve_topology(model, Resolver(base_dir=Path(topology).resolve().parent))
    artifacts = render_topology(model)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir}: exists and is not a folder")
    written = write_artifacts(artifacts, out_dir)
    monitoring = out_dir / OUT_DIR
    for rel, content in observability_files(result.topology).items():
        (monitoring / rel).parent.mkdir(parents=True, exist_ok=True)
        (monitoring / rel).write_text(content, encoding="utf-8")
    return Rendered(len(written), sorted({a.host for a in artifacts}), out_dir, monitoring, list(result.warnings))


def init_topology(request: dict[str, Any], output: Path | None, force: bool) -> str:
    """`bpdkv init`: the scaffolded topology's text (output None), else writes it (and the editor schema beside it) and
    returns the line saying so. Never hands out a topology that does not validate."""
    from bpdkv.init import InitRequest, scaffold_topology, write_schema_beside
    from bpdkv.topology.validate import validate_document
    from bpdkv.topology.yaml_source import parse_yaml

    text = scaffold_topology(InitRequest(**request))
    validate_document(parse_yaml(text, str(output or "<init>")))
    if output is None:
        return text
    if output.exists() and not force:
        raise UsageError(f"{output} exists; pass --force to overwrite it")
    output.write_text(text, encoding="utf-8")
    schema = write_schema_beside(output)
    return f"wrote {output}" + (f" and {schema} (editor schema)" if schema else "") + f"; next: bpdkv validate {output}\n"
