"""Planning as data (pyinfra style): facts JSON in → expected plan JSON out, one generic test for all fixtures.

Facts name file hashes symbolically so fixtures survive template changes: "@rendered" is the hash of what bpdkv
renders now, "@other" any different content, "@manifest" whatever the manifest records. Regenerate the expected
halves with `pytest tests/unit/test_plan_fixtures.py --regen` and review the diff.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy.bootstrap import source_digest, wanted_versions
from bpdkv.deploy.facts import DiskSpace, HostFacts, Listener
from bpdkv.deploy.operations import describe
from bpdkv.deploy.planner import compat_fingerprint, make_plan
from bpdkv.render import render_topology
from bpdkv.topology.validate import load_topology
from tests.conftest import DATA, ROOT

FIXTURES = sorted((DATA / "plan").glob("*.json"))


def _resolve(fixture: dict[str, Any]) -> dict[str, HostFacts]:
    topology = load_topology(ROOT / fixture["topology"]).topology
    artifacts = {(a.host, a.path): a for a in render_topology(topology)}
    facts: dict[str, HostFacts] = {}
    for host, f in fixture["facts"].items():
        if not f.get("reachable", True):
            facts[host] = HostFacts(host, False, f.get("error", "unreachable"))
            continue
        files: dict[str, Any] = {}
        for path, value in f.get("files", {}).items():
            if value is None:
                files[path] = None
                continue
            art = artifacts.get((host, path))
            rendered = hashlib.sha256(art.content.encode()).hexdigest() if art else "0" * 64
            sha = {"@rendered": rendered, "@other": "f" * 64}.get(value, value)
            files[path] = {"sha256": sha, "mode": art.mode if art else 0o644, "content": None}
        manifest = f.get("manifest")
        if manifest is not None:
            manifest = dict(manifest)
            manifest["files"] = {
                p: (
                    hashlib.sha256(artifacts[(host, p)].content.encode()).hexdigest()
                    if v == "@rendered" and (host, p) in artifacts
                    else "f" * 64
                    if v == "@other"
                    else v
                )
                for p, v in manifest.get("files", {}).items()
            }
            compat = dict(compat_fingerprint(topology))
            compat.update(manifest.get("compat_override", {}))
            manifest["compat"] = compat
        # A host bpdkv applied before holds the wanted packages unless the fixture says otherwise.
        node = next(n for n in topology.nodes if n.name == host)
        wanted = {name: version.split(" ")[0] for name, version in wanted_versions(topology, node).items()}
        versions = {k: v for k, v in (f.get("versions", wanted if manifest is not None else {})).items()}
        source = f.get("bpdkv_source", "@current" if manifest is not None else None)
        facts[host] = HostFacts(
            host,
            True,
            None,
            manifest,
            files,
            f.get("units", {}),
            versions=versions,
            bpdkv_source=source_digest() if source == "@current" else source,
            lock=f.get("lock"),
            dirty=f.get("dirty"),
            disk=[DiskSpace(d["path"], d["free_bytes"], d.get("read_only", False)) for d in f.get("disk", [])],
            listeners=[Listener(p["port"], "0.0.0.0", p.get("process", ""), p.get("pid")) for p in f.get("listeners", [])],
        )
    return facts


def _summary(fixture: dict[str, Any]) -> dict[str, Any]:
    topology = load_topology(ROOT / fixture["topology"]).topology
    plan = make_plan(topology, render_topology(topology), _resolve(fixture), tuple(fixture.get("limit", ())), fixture.get("owner"))
    return {
        "exit_code": plan.exit_code,
        "compat_break": plan.compat_break,
        "group": plan.group,
        "problems": [p.line() for p in plan.problems],
        "hosts": {
            h.host: {
                "reachable": h.reachable,
                "files": {f.path: f.symbol + (" drift" if f.drift else "") for f in h.files if f.action != "none"},
                "daemon_reload": h.daemon_reload,
                "units": {u.unit: f"{u.action}: {u.reason}".replace(source_digest(), "@current") for u in h.units},
                "packages": [f"{p.action} {p.line}".replace(source_digest(), "@current") for p in h.packages if p.action != "none"],
                "repair": h.repair,
                "skipped": h.skipped,
                # sha256 of rendered content changes with templates: fixtures keep the operation, not the hash.
                "operations": [_stable(describe(op)) for op in h.operations],
            }
            for h in plan.hosts
        },
        "waves": [[w.role, w.units] for w in plan.waves],
    }


def _stable(line: str) -> str:
    import re

    line = re.sub(r"(generation |backup/)[0-9a-f]{12}", r"\g<1>@current", line)
    return re.sub(r"sha256 [0-9a-f]{12}", "sha256 @rendered", line).replace(source_digest(), "@current")


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_plan_fixture(path: Path, regen: bool) -> None:
    fixture = json.loads(path.read_text())
    got = _summary(fixture)
    if regen:
        fixture["expected"] = got
        path.write_text(json.dumps(fixture, indent=2, ensure_ascii=False) + "\n")
    assert got == fixture["expected"]


def test_enough_fixtures() -> None:
    assert len(FIXTURES) >= 8


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_plan_json_matches_schema(path: Path) -> None:
    from jsonschema import Draft202012Validator

    fixture = json.loads(path.read_text())
    topology = load_topology(ROOT / fixture["topology"]).topology
    plan = make_plan(topology, render_topology(topology), _resolve(fixture))
    schema = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())
    assert [e.message for e in Draft202012Validator(schema).iter_errors(plan.to_json())] == []


def test_secrets_redacted_in_diffs() -> None:
    from bpdkv.deploy.planner import _diff

    diff = _diff("h", "/etc/bpdkv/x.env", "HF_TOKEN=old-secret\nA=1\n", "HF_TOKEN=new-secret\nA=2\n", secret=True)
    assert "secret" not in diff and "HF_TOKEN=<redacted>" in diff and "+A=2" in diff


def test_offline_plan_creates_everything() -> None:
    from bpdkv.deploy.planner import empty_facts

    topology = load_topology(ROOT / "examples" / "p5en-qwen3-32b.yaml").topology
    arts = render_topology(topology)
    plan = make_plan(topology, arts, empty_facts(topology))
    assert plan.exit_code == 2
    assert sum(1 for h in plan.hosts for f in h.files if f.action == "create") == len(arts)


def test_offline_plan_json_of_the_example_shows_every_host_step() -> None:
    """`plan --offline --output json` of the built-in example: each host is locked first and unlocked last, its files
    committed by the script the plan holds (and undone by the restore script it holds), gates with their URLs."""
    from click.testing import CliRunner

    from bpdkv.cli import main

    result = CliRunner().invoke(main, ["plan", "--offline", "--output", "json", str(ROOT / "examples" / "local-cpu.yaml")])
    data = json.loads(result.output)
    assert result.exit_code == 2, result.output
    for host in data["hosts"]:
        kinds = [op["op"] for op in host["operations"]]
        assert kinds[0] == "lock" and kinds[-1] == "unlock", kinds
        assert kinds.index("commit") > max(i for i, k in enumerate(kinds) if k == "upload")
        commit = next(op for op in host["operations"] if op["op"] == "commit")
        assert commit["script"].startswith("set -u\nB=") and commit["restore"].rstrip().endswith("restore")
        assert all(op["base"].startswith("http://127.0.0.1:") for op in host["operations"] if op["op"] == "gate")
