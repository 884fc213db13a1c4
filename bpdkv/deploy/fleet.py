"""The deploy pipeline as a library: topology → render → facts → plan → apply / status / destroy. The CLI only calls this."""

from __future__ import annotations

import json
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric import Connection

from bpdkv.deploy.bootstrap import CREATED_MARKER, Wheelhouse, build_bpdkv_wheel
from bpdkv.deploy.planner import Plan, empty_facts, make_plan
from bpdkv.deploy.remote import MANIFEST_PATH, HostFacts, RemoteError, SshOptions, connect, for_each_host, gather_facts, run
from bpdkv.deploy.runner import ApplyOptions, Executor, HostOutcome, PackageSource, Progress, execute, health_gate, stop_and_disable
from bpdkv.errors import BpdkvError
from bpdkv.render import Artifact, render_topology
from bpdkv.secrets import Resolver, resolve_topology
from bpdkv.topology.loader import ValidatedTopology, load_topology
from bpdkv.topology.model import Node, Topology


class StalePlan(BpdkvError):
    pass


@dataclass
class Fleet:
    """A validated topology, its artifacts, and (after gather) facts and open connections."""

    validated: ValidatedTopology
    artifacts: list[Artifact]
    facts: dict[str, HostFacts] = field(default_factory=dict)
    conns: dict[str, Connection] = field(default_factory=dict)

    @property
    def topology(self) -> Topology:
        return self.validated.topology

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass
        self.conns.clear()


def load_fleet(path: str, resolve_secrets: bool = True) -> Fleet:
    """Secret references are resolved here (plan, apply, status compare the files' contents); destroy needs paths only."""
    validated = load_topology(Path(path), path)
    if resolve_secrets:
        resolved = resolve_topology(validated.topology, Resolver(base_dir=Path(path).resolve().parent))
        validated = ValidatedTopology(resolved, validated.warnings, validated.file)
    return Fleet(validated, render_topology(validated.topology))


def gather(fleet: Fleet, ssh: SshOptions, parallel: int) -> None:
    """Connect to every node and read facts (read-only). Unreachable hosts become facts with an error."""
    topology = fleet.topology

    def one(node: Node) -> tuple[HostFacts, Connection | None]:
        mine = [a for a in fleet.artifacts if a.host == node.name]
        try:
            conn = connect(node, ssh)
        except RemoteError as exc:
            return HostFacts(node.name, False, exc.reason), None
        try:
            facts = gather_facts(conn, node.name, [a.path for a in mine], [a.unit for a in mine if a.unit], topology.vllm.venv, ssh)
        except RemoteError as exc:
            conn.close()
            return HostFacts(node.name, False, exc.reason), None
        return facts, conn

    for node, result in zip(topology.nodes, for_each_host(list(topology.nodes), one, parallel), strict=True):
        if isinstance(result, Exception):
            fleet.facts[node.name] = HostFacts(node.name, False, f"{type(result).__name__}: {result}")
            continue
        facts, conn = result
        fleet.facts[node.name] = facts
        if conn is not None:
            fleet.conns[node.name] = conn


def plan_fleet(fleet: Fleet, offline: bool, ssh: SshOptions, parallel: int) -> Plan:
    if offline:
        fleet.facts = empty_facts(fleet.topology)
    else:
        gather(fleet, ssh, parallel)
    return make_plan(fleet.topology, fleet.artifacts, fleet.facts)


def save_plan(plan: Plan, fleet: Fleet, path: Path) -> None:
    data = plan.to_json()
    data["topology_file"] = str(Path(fleet.validated.file).resolve())
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    path.chmod(0o600)  # diffs are redacted, but a plan still describes the fleet


def load_saved_plan(path: Path) -> tuple[Plan, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Plan.from_json(data), data["topology_file"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BpdkvError(f"{path}: not a saved bpdkv plan ({type(exc).__name__}: {exc})") from None


def check_saved_plan(saved: Plan, fresh: Plan) -> None:
    """A saved plan applies only to the hosts and topology it was made from."""
    if saved.generation != fresh.generation:
        raise StalePlan(f"the topology changed since the plan was saved (generation {saved.generation} → {fresh.generation}); plan again")
    fresh_digests = {h.host: h.facts_digest for h in fresh.hosts}
    changed = [h.host for h in saved.hosts if fresh_digests.get(h.host) != h.facts_digest]
    if changed:
        raise StalePlan(f"host facts changed since the plan was saved ({', '.join(changed)}: drift or another apply); plan again")


def wheelhouse_path(fleet: Fleet) -> Path | None:
    """bootstrap.wheelhouse, relative to the topology file."""
    where = fleet.topology.bootstrap.wheelhouse
    if where is None:
        return None
    path = Path(where).expanduser()
    return path if path.is_absolute() else Path(fleet.validated.file).resolve().parent / path


def package_source(fleet: Fleet, workdir: Path) -> PackageSource:
    """The wheelhouse when the topology names one (checked against this CLI's build), else bpdkv's wheel built now."""
    house_dir = wheelhouse_path(fleet)
    if house_dir is not None:
        house = Wheelhouse.load(house_dir)
        house.check_current()
        return PackageSource({name: house_dir / name for name in house.files}, house.bpdkv_wheel, offline=True)
    wheel = build_bpdkv_wheel(workdir)
    return PackageSource({wheel.name: wheel}, wheel.name, offline=False)


def apply_plan(fleet: Fleet, plan: Plan, options: ApplyOptions, progress: Progress | None = None) -> dict[str, HostOutcome]:
    with tempfile.TemporaryDirectory(prefix="bpdkv-wheel-") as tmp:
        packages = package_source(fleet, Path(tmp)) if any(h.installs for h in plan.hosts if h.reachable) else None
        executor = Executor(fleet.topology, fleet.artifacts, plan, fleet.conns, options, progress, packages, fleet.facts)
        return execute(executor, lambda items, fn: for_each_host(items, fn, options.parallel))


@dataclass
class InstanceStatus:
    node: str
    instance: str
    role: str
    unit: str
    state: str
    health: str
    drift: list[str]
    versions: dict[str, str]

    @property
    def healthy(self) -> bool:
        return self.state == "active" and self.health == "ok" and not self.drift


def status(fleet: Fleet, ssh: SshOptions, parallel: int, health_timeout: float = 3.0) -> list[InstanceStatus]:
    gather(fleet, ssh, parallel)
    out: list[InstanceStatus] = []
    for node in fleet.topology.nodes:
        facts = fleet.facts[node.name]
        manifest_files = (facts.manifest or {}).get("files", {}) if isinstance(facts.manifest, dict) else {}
        for inst in node.instances:
            if not facts.reachable:
                out.append(InstanceStatus(node.name, inst.name, inst.role, inst.unit, "unreachable", facts.error or "", [], {}))
                continue
            mine = [a.path for a in fleet.artifacts if a.host == node.name and a.instance == inst.name]
            drift = [p for p in mine if p in manifest_files and (facts.files.get(p) or {}).get("sha256") != manifest_files[p]]
            missing = [p for p in mine if p not in manifest_files]
            state = facts.units.get(inst.unit, "unknown")
            failure = health_gate(node.host, inst.port, health_timeout, probe_interval=0.3) if state == "active" else "not running"
            health = "ok" if failure is None else failure
            if missing:
                health = "not deployed" if state != "active" else health
            out.append(InstanceStatus(node.name, inst.name, inst.role, inst.unit, state, health, drift, facts.versions))
    return out


def destroy(fleet: Fleet, ssh: SshOptions, parallel: int, progress: Progress | None = None, keep_packages: bool = False) -> dict[str, str]:
    """Stop and disable bpdkv units and remove exactly the files in each host's manifest, and the venv + wheelhouse the
    bootstrap installed (unless keep_packages); nothing else."""
    gather(fleet, ssh, parallel)
    report = progress or (lambda h, m: None)

    def one(node: Node) -> str:
        facts = fleet.facts[node.name]
        if not facts.reachable:
            return f"unreachable: {facts.error}"
        manifest = facts.manifest if isinstance(facts.manifest, dict) else None
        if not manifest:
            return "nothing to destroy (no manifest)"
        conn = fleet.conns[node.name]
        for unit in manifest.get("units", []):
            run(conn, node.name, stop_and_disable(unit), ssh, check=False)
            report(node.name, f"stopped {unit}")
        paths = sorted(manifest.get("files", {}))
        if paths:
            run(conn, node.name, "rm -f " + " ".join(shlex.quote(p) for p in paths), ssh)
            # Folders bpdkv made for its files go too, but only when empty (rmdir); system folders stay.
            parents = sorted({p.rsplit("/", 1)[0] for p in paths} - {"/etc/systemd/system", "/etc", "/opt", "/"}, reverse=True)
            if parents:
                run(conn, node.name, "rmdir " + " ".join(shlex.quote(d) for d in parents) + " 2>/dev/null; true", ssh, check=False)
        run(conn, node.name, "systemctl daemon-reload", ssh, check=False)
        # Work directories go only if empty (they may hold caches the user wants); backups are bpdkv's own.
        instances = manifest.get("instances", {}).values()
        dirs = " ".join(shlex.quote(f"/var/lib/bpdkv/{i}") for i in instances)
        packages = manifest.get("packages") if isinstance(manifest.get("packages"), dict) else None
        removed_packages = ""
        if packages and not keep_packages:
            # Only folders bpdkv itself made: absolute, at least two levels deep (never /, /opt or /usr).
            owned = [
                p
                for p in (packages.get("venv"), packages.get("wheelhouse"))
                if isinstance(p, str) and p.startswith("/") and p.rstrip("/").count("/") >= 2
            ]
            if owned:
                # Stragglers still running from the venv (e.g. multiprocessing helpers of a vLLM whose unit manager
                # does not kill the whole cgroup) would keep the deleted files open: end them first, by executable path.
                pattern = shlex.quote("^" + packages["venv"].rstrip("/") + "/bin/")
                run(
                    conn,
                    node.name,
                    f"pkill -TERM -f {pattern} 2>/dev/null; for i in 1 2 3 4 5; do pgrep -f {pattern} >/dev/null || break; sleep 1; done; "
                    f"pkill -KILL -f {pattern} 2>/dev/null; true",
                    ssh,
                    check=False,
                )
                # The venv only if the bootstrap created it (a venv the user pointed vllm.venv at stays).
                script = [f"rm -rf {shlex.quote(p)}" for p in owned if p != packages.get("venv")]
                venv = shlex.quote(packages["venv"])
                script.append(f"if [ -f {venv}/{CREATED_MARKER} ]; then rm -rf {venv}; else echo kept; fi")
                _, said, _ = run(conn, node.name, "; ".join(script), ssh)
                removed_packages = ", " + " and ".join(p for p in owned if p != packages.get("venv") or "kept" not in said)
        run(conn, node.name, f"rmdir {dirs} 2>/dev/null; rm -rf /var/lib/bpdkv/backup; rm -f {MANIFEST_PATH}; true", ssh)
        return f"removed {len(paths)} file(s), {len(manifest.get('units', []))} unit(s){removed_packages}"

    results = for_each_host(list(fleet.topology.nodes), one, parallel)
    return {n.name: (r if isinstance(r, str) else f"failed: {r}") for n, r in zip(fleet.topology.nodes, results, strict=True)}


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {
        "create": sum(1 for h in plan.hosts for f in h.files if f.action == "create"),
        "update": sum(1 for h in plan.hosts for f in h.files if f.action == "update"),
        "delete": sum(1 for h in plan.hosts for f in h.files if f.action == "delete"),
        "restart": sum(1 for h in plan.hosts for u in h.units if u.action in ("start", "restart")),
        "stop": sum(1 for h in plan.hosts for u in h.units if u.action == "stop"),
    }
