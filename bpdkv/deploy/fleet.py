"""The deploy pipeline as a library: topology → render → facts → plan → run / status / destroy. The CLI only calls this."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpdkv.deploy import hardware, linkseed
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import CREATED_MARKER, Wheelhouse, build_bpdkv_wheel, source_digest
from bpdkv.deploy.connectors import Connector, ConnectorError, probe
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions
from bpdkv.deploy.facts import (
    BACKUP_DIR,
    DIRTY_PATH,
    LOCK_PATH,
    MANIFEST_PATH,
    DebPackages,
    DeployState,
    DiskFree,
    Fact,
    HostFacts,
    ListeningPorts,
    MemlockLimit,
    PreflightProblem,
    batch_command,
    split_batch,
)
from bpdkv.deploy.inventory import Inventory, load_with_inventory, membership_change
from bpdkv.deploy.planner import (
    FileAction,
    FileChange,
    HostPlan,
    Plan,
    UnitAction,
    UnitVerb,
    empty_facts,
    fact_differences,
    facts_detail,
    facts_digest,
    facts_parts,
    make_plan,
)
from bpdkv.deploy.runner import ApplyOptions, HostOutcome, HostStatus, PackageSource, Progress, Report, Runner, for_each_host
from bpdkv.errors import BpdkvError
from bpdkv.render import Artifact, render_topology, system_packages
from bpdkv.secret_refs import Resolver, health_probe, resolve_topology
from bpdkv.topology.model import Node, Topology
from bpdkv.topology.validate import ValidatedTopology, load_topology

ConnectorFactory = Callable[[Node], Connector]


class StalePlan(BpdkvError):
    """A saved plan that no longer matches its hosts: one line per difference, then what to do."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("saved plan refused: " + "; ".join(problems) + "; plan again")
        self.problems = problems

    def lines(self) -> list[str]:
        return [f"saved plan refused: {p}" for p in self.problems] + ["plan again: bpdkv plan TOPOLOGY --out PLAN.json"]


@dataclass
class Fleet:
    """A validated topology, its artifacts, and (after gather) facts and open connections."""

    validated: ValidatedTopology
    artifacts: list[Artifact]
    facts: dict[str, HostFacts] = field(default_factory=dict)
    conns: dict[str, Connector] = field(default_factory=dict)
    hardware: dict[str, list[PreflightProblem]] = field(default_factory=dict)
    inventory: Inventory | None = None  # the EC2 node groups' instances (None: every node is written in the file)

    @property
    def topology(self) -> Topology:
        return self.validated.topology

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def load_fleet(path: str, resolve_secrets: bool = True, offline: bool = False) -> Fleet:
    """Secret references are resolved here (plan, apply, status compare the files' contents); destroy needs paths only.
    `offline` (plan --offline): EC2 is not asked; each node group is one placeholder machine, as validate checks it,
    and the fleet's warnings say so."""
    if offline:
        validated, inventory = load_topology(Path(path), path), None
    else:
        validated, inventory = load_with_inventory(path)
    if resolve_secrets:
        resolved = resolve_topology(validated.topology, Resolver(base_dir=Path(path).resolve().parent))
        validated = ValidatedTopology(resolved, validated.warnings, validated.file)
    return Fleet(validated, render_topology(validated.topology), inventory=inventory)


def ssh_factory(options: SshOptions) -> ConnectorFactory:
    return lambda node: SshConnector(node, options)


def lock_owner() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def _host_facts(topology: Topology, node: Node, artifacts: list[Artifact]) -> list[Fact[Any]]:
    mine = [a for a in artifacts if a.host == node.name]
    # Every folder a commit writes: the files' own (staged copies), the backup folder, the manifest's.
    folders = sorted({a.path.rsplit("/", 1)[0] or "/" for a in mine} | {"/var/lib/bpdkv", BACKUP_DIR, MANIFEST_PATH.rsplit("/", 1)[0]})
    return [
        DeployState(
            [a.path for a in mine],
            [a.unit for a in mine if a.unit],
            topology.vllm.venv,
            sorted({a.reader for a in mine if a.reader}),
            {i.unit: i.port for i in node.instances if i.role in ("prefill", "decode") and i.port is not None},
        ),
        DiskFree(folders),
        ListeningPorts(),
        MemlockLimit(),
        DebPackages(system_packages(topology).get(node.name, ())),
    ]


def gather(fleet: Fleet, parallel: int, connect: ConnectorFactory, force_unlock: bool = False) -> None:
    """Connect to every node and read facts in one round trip each (read-only, unless force_unlock removes a stale lock).
    Unreachable hosts become facts with an error."""
    topology = fleet.topology

    def one(node: Node) -> tuple[HostFacts, Connector | None, list[PreflightProblem]]:
        try:
            conn = connect(node)
        except ConnectorError as exc:
            return HostFacts(node.name, False, exc.reason), None, []
        try:
            if force_unlock:
                conn.run(f"rm -f {LOCK_PATH}")
            facts = _host_facts(topology, node, fleet.artifacts)
            # GPUs, EFA, libfabric, kernel: only where engines run (a router-only node needs no accelerator).
            extra: list[Fact[Any]] = list(hardware.HARDWARE_FACTS) if any(i.role != "router" for i in node.instances) else []
            result = conn.run(batch_command([*facts, *extra]), 120)
            outputs = split_batch(result.stdout, len(facts) + len(extra))
            try:
                state = facts[0].parse(outputs[0])
            except (ValueError, IndexError):
                raise ConnectorError(node.name, f"facts script printed no JSON: {outputs[0][:200]!r}") from None
            host = HostFacts(node=node.name, reachable=True, **state)
            host.disk = facts[1].parse(outputs[1])
            host.listeners = facts[2].parse(outputs[2])
            try:
                host.memlock_kib = facts[3].parse(outputs[3])
            except ValueError:
                host.memlock_kib = 0
            host.debian = facts[4].parse(outputs[4])
            host.hardware = {f.name: f.parse(out) for f, out in zip(extra, outputs[len(facts) :], strict=True)}
        except ConnectorError as exc:
            conn.close()
            return HostFacts(node.name, False, exc.reason), None, []
        problems = hardware.check_hardware(topology, node, host.hardware) + hardware.memlock_problems(node, fleet.artifacts)
        return host, conn, problems

    for node, (facts, conn, problems) in zip(topology.nodes, for_each_host(list(topology.nodes), one, parallel), strict=True):
        fleet.facts[node.name] = facts
        fleet.hardware[node.name] = problems
        if conn is not None:
            fleet.conns[node.name] = conn


def plan_fleet(
    fleet: Fleet,
    offline: bool,
    parallel: int,
    connect: ConnectorFactory | None = None,
    limit: tuple[str, ...] = (),
    owner: str | None = None,
    force_unlock: bool = False,
    start_timeout: float | None = None,
    max_unavailable: int = 1,
) -> Plan:
    if offline:
        fleet.facts = empty_facts(fleet.topology)
    else:
        gather(fleet, parallel, connect or ssh_factory(SshOptions()), force_unlock)
    plan = make_plan(
        fleet.topology, fleet.artifacts, fleet.facts, limit, owner, system_packages(fleet.topology), start_timeout, max_unavailable
    )
    for host in plan.hosts:
        host.problems.extend(fleet.hardware.get(host.host, []) if not host.skipped else [])
    return plan


# ---- saved plans -----------------------------------------------------------------------------------------------------


def save_plan(plan: Plan, fleet: Fleet, path: Path) -> None:
    data = plan.to_json()
    data["topology_file"] = str(Path(fleet.validated.file).resolve())
    data["facts_parts"] = {h: facts_parts(f) for h, f in fleet.facts.items() if f.reachable}
    data["facts_detail"] = {h: facts_detail(f) for h, f in fleet.facts.items() if f.reachable}  # names each difference
    if fleet.inventory is not None:
        data["inventory"] = fleet.inventory.to_json()  # apply refuses if the groups select other instances by then
    for host in data["hosts"]:
        for f in host["files"]:
            if any(a.secret and a.path == f["path"] and a.host == host["host"] for a in fleet.artifacts):
                f["diff"] = "(secret: only its sha256 is kept)" if f["diff"] else ""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    path.chmod(0o600)  # diffs are redacted, but a plan still describes the fleet


@dataclass(frozen=True)
class SavedPlan:
    plan: Plan
    topology_file: str
    facts_parts: dict[str, dict[str, str]]
    membership: dict[str, list[str]] | None = None  # EC2 group → instance ids when the plan was made
    facts_detail: dict[str, dict[str, Any]] = field(default_factory=dict)  # per host: files, units, packages (no content)


def load_saved_plan(path: Path) -> SavedPlan:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        membership = data["inventory"]["groups"] if "inventory" in data else None
        return SavedPlan(Plan.from_json(data), data["topology_file"], data.get("facts_parts", {}), membership, data.get("facts_detail", {}))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BpdkvError(f"{path}: not a saved bpdkv plan ({type(exc).__name__}: {exc})") from None


def check_saved_plan(saved: SavedPlan, fresh: Plan, fleet: Fleet) -> None:
    """A saved plan runs only on the hosts, topology and CLI build it was made from; every difference is named."""
    plan = saved.plan
    problems: list[str] = []
    if saved.membership is not None and fleet.inventory is not None:
        change = membership_change(saved.membership, fleet.inventory)
        if change:
            problems.append(change)
    if plan.cli_build != fresh.cli_build:
        problems.append(f"the plan was made by another bpdkv build ({plan.cli_build} here {fresh.cli_build}); plan again with this CLI")
    if plan.generation != fresh.generation:
        problems.append(f"the topology or its rendered files changed (generation {plan.generation} → {fresh.generation})")
    if plan.limit != fresh.limit:
        problems.append(f"--limit differs from the plan's ({plan.limit or 'all hosts'})")
    fresh_hosts = {h.host: h for h in fresh.hosts}
    for h in plan.hosts:
        now = fresh_hosts.get(h.host)
        if now is None:
            problems.append(f"{h.host}: no longer in the topology")
        elif not now.reachable and not now.skipped:
            problems.append(f"{h.host}: {now.error}")
        elif now.facts_digest != h.facts_digest and not h.skipped:
            differences = fact_differences(h.host, saved.facts_detail[h.host], fleet.facts[h.host]) if h.host in saved.facts_detail else []
            if not differences:  # a plan saved before facts_detail existed: the kinds of facts that changed
                before = saved.facts_parts.get(h.host, {})
                after = facts_parts(fleet.facts[h.host])
                what = [k for k in after if before.get(k) != after[k]] or ["facts"]
                differences = [f"{h.host}: {', '.join(what)} changed"]
            problems += [f"{line} (since the plan was saved: drift or another apply)" for line in differences]
    if problems:
        raise StalePlan(problems)


# ---- apply -----------------------------------------------------------------------------------------------------------


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


def apply_plan(fleet: Fleet, plan: Plan, options: ApplyOptions, progress: Progress | None = None) -> Report:
    """Run exactly the plan's operations. Preflight problems on any selected host → nothing is written anywhere."""
    problems = plan.problems
    if problems:
        report = Report({h.host: _not_started(h) for h in plan.hosts}, [p.line() for p in problems])
        return report
    installs = any(isinstance(op, ops.InstallPackages) for h in plan.hosts for op in h.operations)
    with tempfile.TemporaryDirectory(prefix="bpdkv-wheel-") as tmp:
        packages = package_source(fleet, Path(tmp)) if installs else None
        runner = Runner(fleet.topology, fleet.artifacts, plan, fleet.conns, options, progress, packages, fleet.facts)
        return runner.run()


def _not_started(h: HostPlan) -> HostOutcome:
    return HostOutcome(h.host, HostStatus.SKIPPED if h.skipped else HostStatus.NOT_STARTED, "nothing written: preflight failed")


# ---- status ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceStatus:
    node: str
    instance: str
    role: str
    unit: str
    state: str
    health: str
    drift: list[str]
    versions: dict[str, str]
    links: list[str] = field(default_factory=list)  # a prefill's links as apply measured them (its seed): rate, overhead, age

    @property
    def healthy(self) -> bool:
        return self.state == "active" and self.health == "ok" and not self.drift


def status(fleet: Fleet, parallel: int, connect: ConnectorFactory | None = None, health_timeout: float = 3.0) -> list[InstanceStatus]:
    """The same facts and the same planner as `plan`: an instance drifts exactly when the plan would change it."""
    plan = plan_fleet(fleet, False, parallel, connect)
    by_host = {h.host: h for h in plan.hosts}
    refused = router_refusals(fleet)

    def one(node: Node) -> list[InstanceStatus]:
        facts = fleet.facts[node.name]
        hp = by_host[node.name]
        rows = []
        for inst in node.instances:
            if not facts.reachable:
                rows.append(InstanceStatus(node.name, inst.name, inst.role, inst.unit, "unreachable", facts.error or "", [], {}))
                continue
            drift = [f.path for f in hp.files if f.instance == inst.name and f.action != "none"]
            drift += [f"unit: {u.action} ({u.reason})" for u in hp.units if u.instance == inst.name and u.action != "none" and not drift]
            if hp.repair:
                drift.append(f"host: {hp.repair}")
            state = facts.units.get(inst.unit, "unknown")
            health = "not running"
            if state == "active" and inst.port is not None:
                base, paths = health_probe(inst.role, fleet.topology.router, "127.0.0.1", inst.port)
                answer = probe(fleet.conns[node.name], base, paths, health_timeout, 0.3)
                health = "ok" if answer.failure is None else answer.failure
                if health == "ok" and inst.name in refused:
                    health = refused[inst.name]  # it answers, but the router does not use it: not ok
            links: list[str] = []
            if inst.role == "prefill" and fleet.topology.kv_transfer.connector == "bpdkv":
                seed = fleet.conns[node.name].run(f"cat {shlex.quote(linkseed.seed_path(inst.name))} 2>/dev/null || true").stdout
                links = linkseed.status_lines(seed, time.time())
            rows.append(InstanceStatus(node.name, inst.name, inst.role, inst.unit, state, health, drift, facts.versions, links))
        return rows

    def guarded(node: Node) -> list[InstanceStatus]:
        try:
            return one(node)
        except ConnectorError as exc:
            return [InstanceStatus(node.name, i.name, i.role, i.unit, "unreachable", exc.reason, [], {}) for i in node.instances]

    return [row for rows in for_each_host(list(fleet.topology.nodes), guarded, parallel) for row in rows]


def refusals(listing: Any) -> dict[str, str]:
    """Engines the router refuses to use (GET /admin/upstreams `state` mismatched: not of their generation), with why."""
    out: dict[str, str] = {}
    for u in listing.get("upstreams", []) if isinstance(listing, dict) else []:
        if isinstance(u, dict) and u.get("state") == "mismatched" and u.get("name"):
            out[str(u["name"])] = f"refused by the router: not of its generation ({u.get('problem') or 'another release or model'})"
    return out


def router_refusals(fleet: Fleet) -> dict[str, str]:
    """What the running router says of the engines it refuses (status); nothing when no router runs or it cannot say."""
    from bpdkv.deploy.planner import _admin_key_file, _router
    from bpdkv.secret_refs import router_base

    router = _router(fleet.topology, fleet.facts)
    if router is None or router[0] not in fleet.conns:
        return {}
    base = router_base(fleet.topology.router, "127.0.0.1", router[1])
    try:
        answer = probe(fleet.conns[router[0]], base, ["/admin/upstreams"], 10.0, once=True, bearer_file=_admin_key_file(fleet.topology))
    except ConnectorError:
        return {}
    if answer.failure:
        return {}
    try:
        return refusals(json.loads(answer.body))
    except ValueError:
        return {}


# ---- destroy ---------------------------------------------------------------------------------------------------------


REMOVAL_GENERATION = "0" * 12


def removal_plan(fleet: Fleet, keep_packages: bool) -> Plan:
    """destroy as a plan: stop the manifest's units, delete exactly its files, then clean up what bpdkv made."""
    hosts: list[HostPlan] = []
    for node in fleet.topology.nodes:
        facts = fleet.facts[node.name]
        manifest = facts.manifest if isinstance(facts.manifest, dict) and facts.reachable else None
        if not facts.reachable or not manifest:
            hosts.append(HostPlan(node.name, node.host, facts.reachable, facts.error, [], False, [], ""))
            continue
        operations: list[ops.Operation] = [
            ops.StopUnit(unit, manifest.get("instances", {}).get(unit, unit), "destroy") for unit in manifest.get("units", [])
        ]
        paths = sorted(manifest.get("files", {}))
        operations += [ops.DeleteFile(p) for p in paths]
        operations.append(ops.DaemonReload())
        operations += _cleanup(manifest, paths, keep_packages)
        operations = ops.stage_operations(REMOVAL_GENERATION, fleet.topology.name, operations)
        files = [FileChange(p, FileAction.DELETE, 0, None) for p in paths]
        units = [UnitAction(u, u, "removed", UnitVerb.STOP, "destroy") for u in manifest.get("units", [])]
        hosts.append(HostPlan(node.name, node.host, True, None, files, True, units, facts_digest(facts), operations=operations))
    return Plan(fleet.topology.name, REMOVAL_GENERATION, "", False, [], hosts, [], source_digest())


def _cleanup(manifest: dict[str, Any], paths: list[str], keep_packages: bool) -> list[ops.Operation]:
    out: list[ops.Operation] = []
    # Folders bpdkv made for its files go too, but only when empty (rmdir); system folders stay.
    parents = sorted({p.rsplit("/", 1)[0] for p in paths} - {"/etc/systemd/system", "/etc", "/opt", "/"}, reverse=True)
    if parents:
        out.append(ops.RunCommand("rmdir " + " ".join(shlex.quote(d) for d in parents) + " 2>/dev/null; true", "remove empty folders"))
    packages = manifest.get("packages") if isinstance(manifest.get("packages"), dict) else None
    if packages and not keep_packages:
        # Only folders bpdkv itself made: absolute, at least two levels deep (never /, /opt or /usr).
        owned = [
            p
            for p in (packages.get("venv"), packages.get("wheelhouse"))
            if isinstance(p, str) and p.startswith("/") and p.rstrip("/").count("/") >= 2
        ]
        if owned and isinstance(packages.get("venv"), str):
            venv = packages["venv"]
            # Stragglers still running from the venv would keep the deleted files open: end them first, by executable path.
            pattern = shlex.quote("^" + venv.rstrip("/") + "/bin/")
            out.append(
                ops.RunCommand(
                    f"pkill -TERM -f {pattern} 2>/dev/null; for i in 1 2 3 4 5; do pgrep -f {pattern} >/dev/null || break; sleep 1; done; "
                    f"pkill -KILL -f {pattern} 2>/dev/null; true",
                    f"end processes still running from {venv}",
                )
            )
            script = [f"rm -rf {shlex.quote(p)}" for p in owned if p != venv]
            # The venv only if the bootstrap created it (a venv the user pointed vllm.venv at stays).
            script.append(f"if [ -f {shlex.quote(venv)}/{CREATED_MARKER} ]; then rm -rf {shlex.quote(venv)}; fi")
            out.append(ops.RunCommand("; ".join(script), "remove " + " and ".join(owned) + " (the venv only if bootstrap made it)"))
    instances = manifest.get("instances", {}).values()
    dirs = " ".join(shlex.quote(f"/var/lib/bpdkv/{i}") for i in instances)
    out.append(
        ops.RunCommand(
            f"rmdir {dirs} 2>/dev/null; rm -rf /var/lib/bpdkv/backup; rm -f {MANIFEST_PATH} {DIRTY_PATH}; true",
            "remove the manifest and backups",
        )
    )
    return out


def destroy(
    fleet: Fleet, parallel: int, connect: ConnectorFactory | None = None, progress: Progress | None = None, keep_packages: bool = False
) -> Report:
    gather(fleet, parallel, connect or ssh_factory(SshOptions()))
    plan = removal_plan(fleet, keep_packages)
    return apply_plan(fleet, plan, ApplyOptions(parallel=parallel, owner=lock_owner()), progress)


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {
        "create": sum(1 for h in plan.hosts for f in h.files if f.action == "create"),
        "update": sum(1 for h in plan.hosts for f in h.files if f.action == "update"),
        "delete": sum(1 for h in plan.hosts for f in h.files if f.action == "delete"),
        "restart": sum(1 for h in plan.hosts for u in h.units if u.action in ("start", "restart")),
        "stop": sum(1 for h in plan.hosts for u in h.units if u.action == "stop"),
    }


# ---- the commands' workflows: the CLI parses, calls one of these, prints, and exits with the code the result owns ----


def connect(accept_new_host_keys: bool = False, command_timeout: float = 120.0) -> ConnectorFactory:
    """SSH connections as the command line's flags ask (known hosts, the per-command timeout)."""
    return ssh_factory(SshOptions(accept_new_host_keys=accept_new_host_keys, command_timeout=command_timeout))


def plan_topology(
    topology: str,
    offline: bool,
    parallel: int,
    connect: ConnectorFactory,
    limit: tuple[str, ...],
    out_file: Path | None,
    max_unavailable: int = 1,
) -> tuple[Plan, list[Any]]:
    """`bpdkv plan`: the plan (saved to `out_file` when given) and the warnings to show (offline: node-group placeholders)."""
    fleet = load_fleet(topology, offline=offline)
    try:
        plan = plan_fleet(fleet, offline, parallel, connect, limit, max_unavailable=max_unavailable)
    finally:
        fleet.close()
    if out_file is not None:
        save_plan(plan, fleet, out_file)
    return plan, list(fleet.validated.warnings) if offline else []


@dataclass
class ApplyJob:
    """What `bpdkv apply TARGET` will run: a saved plan (checked against a fresh one, runs exactly as saved) or a fresh
    plan of a topology. Holds the fleet's connections until `close`."""

    fleet: Fleet
    plan: Plan
    saved: bool
    owner: str

    @property
    def nothing_to_do(self) -> bool:
        return not self.plan.has_changes and not self.plan.has_errors

    def refused_downtime(self, allow_downtime: bool) -> str | None:
        """Why apply refuses to run this plan: its restarts leave no generation serving and downtime was not allowed."""
        if self.plan.downtime and not allow_downtime:
            return f"refusing to apply: {self.plan.downtime} (pass --allow-downtime to accept it)"
        return None

    @property
    def needs_confirmation(self) -> bool:
        """A fresh plan is shown and confirmed first; a saved one was reviewed when it was saved."""
        return not self.saved and not self.plan.has_errors

    def run(self, parallel: int, max_unavailable: int, progress: Progress | None = None) -> Report:
        options = ApplyOptions(parallel=parallel, max_unavailable=max_unavailable, owner=self.owner)
        return apply_plan(self.fleet, self.plan, options, progress)

    def close(self) -> None:
        self.fleet.close()


def prepare_apply(
    target: str,
    limit: tuple[str, ...],
    parallel: int,
    connect: ConnectorFactory,
    force_unlock: bool = False,
    start_timeout: float | None = None,
    max_unavailable: int = 1,
) -> ApplyJob:
    """TARGET is a topology, or a plan saved with `plan --out` (*.json: its topology and --limit are the saved ones)."""
    saved = None
    topology_file = target
    if target.endswith(".json"):
        saved = load_saved_plan(Path(target))
        topology_file = saved.topology_file
        limit = tuple(saved.plan.limit)
    fleet = load_fleet(topology_file)
    owner = lock_owner()
    try:
        fresh = plan_fleet(fleet, False, parallel, connect, limit, owner, force_unlock, start_timeout, max_unavailable)
        if saved is not None:
            check_saved_plan(saved, fresh, fleet)
    except BaseException:
        fleet.close()
        raise
    return ApplyJob(fleet, saved.plan if saved is not None else fresh, saved is not None, owner)


@dataclass(frozen=True)
class FleetStatus:
    rows: list[InstanceStatus]

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.rows)

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "instances": [dict(vars(r), healthy=r.healthy) for r in self.rows]}


def fleet_status(topology: str, parallel: int, connect: ConnectorFactory) -> FleetStatus:
    fleet = load_fleet(topology)
    try:
        return FleetStatus(status(fleet, parallel, connect))
    finally:
        fleet.close()


def destroy_topology(topology: str, parallel: int, connect: ConnectorFactory, progress: Progress, keep_packages: bool) -> Report:
    fleet = load_fleet(topology, resolve_secrets=False)
    try:
        return destroy(fleet, parallel, connect, progress, keep_packages)
    finally:
        fleet.close()


def inventory(topology: str) -> tuple[ValidatedTopology, Inventory | None]:
    """`bpdkv inventory`: the validated topology and the instances its EC2 node groups select now (None: no groups)."""
    return load_with_inventory(topology)


def wheelhouse(topology: str, out: Path, python_version: str | None, platform: str | None) -> list[str]:
    """`bpdkv wheelhouse build`: fill `out`; the lines saying what it holds and what to do next."""
    from bpdkv.deploy.bootstrap import build_wheelhouse

    house = build_wheelhouse(load_topology(Path(topology), topology).topology, out, python_version, platform)
    size = sum((out / f).stat().st_size for f in house.files) / 1e6
    return [
        f"{out}: {len(house.files)} files, {size:.1f} MB, bpdkv {house.source_digest}, Python {house.python}",
        f"set bootstrap.wheelhouse: {out} in the topology; apply pushes it and installs with --no-index",
    ]
