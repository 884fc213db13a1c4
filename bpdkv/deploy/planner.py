"""Facts + rendered artifacts → Plan. Pure: no network, no clock (golden/fixture testable, like pyinfra's operations)."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from bpdkv import __version__, contracts
from bpdkv.deploy import cohorts, linkseed
from bpdkv.deploy import efa as efa_probe
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import PackageChange, package_changes, source_digest
from bpdkv.deploy.facts import BACKUP_DIR, MANIFEST_PATH, NODE_WHEELHOUSE, DiskSpace, HostFacts, PreflightProblem
from bpdkv.generations import compat_fingerprint, router_generation  # the compatibility break, defined once (re-exported)
from bpdkv.render import Artifact
from bpdkv.secret_refs import health_probe, router_base, secret_diff
from bpdkv.topology.model import Node, Topology

SECRET_KEY = re.compile(r"(?i)(key|token|secret|passw|credential|auth)")
ROLE_ORDER = ("prefill", "decode", "router")
PROBE_TIMEOUT = 120.0  # seconds for each request of the EFA probe turn (P, D, /metrics)
DISK_MARGIN = 16 * 1024 * 1024  # bytes free beyond the files themselves (backups, temp copies, the manifest)


class FileAction(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"
    NONE = "none"

    @property
    def symbol(self) -> str:
        return {"create": "+", "update": "~", "delete": "-", "none": " "}[self.value]


class UnitVerb(StrEnum):
    START = "start"
    RESTART = "restart"
    STOP = "stop"
    NONE = "none"


class WaveAction(StrEnum):
    STOP = "stop"  # units no longer in the topology
    START_OR_RESTART = "start/restart"


@dataclass(frozen=True)
class Wave:
    """One step of the rollout order: `role`'s units (host:unit), started or stopped together."""

    role: str  # prefill | decode | router | removed
    action: WaveAction
    units: list[str]


@dataclass(frozen=True)
class FileChange:
    path: str
    action: FileAction
    mode: int
    instance: str | None
    drift: bool = False  # the file differs from what the last apply wrote (edited by hand)
    diff: str = ""

    @property
    def symbol(self) -> str:
        return self.action.symbol


@dataclass(frozen=True)
class UnitAction:
    unit: str
    instance: str
    role: str
    action: UnitVerb
    reason: str
    port: int | None = None
    new: bool = False  # its unit file is created by this apply: a rollback stops it (never matched from `reason`)


@dataclass(frozen=True)
class HostPlan:
    host: str  # node name
    address: str
    reachable: bool
    error: str | None
    files: list[FileChange]
    daemon_reload: bool
    units: list[UnitAction]
    facts_digest: str
    packages: list[PackageChange] = field(default_factory=list)
    operations: list[ops.Operation] = field(default_factory=list)
    problems: list[PreflightProblem] = field(default_factory=list)
    repair: str | None = None  # the host's record disagrees with its files (unfinished apply): the manifest is rewritten
    skipped: bool = False  # left out by --limit: not touched, not counted
    system_packages: list[str] = field(default_factory=list)  # Debian packages to install (missing on the host)

    @property
    def changed(self) -> bool:
        if self.skipped:
            return False
        return (
            any(f.action != "none" for f in self.files)
            or any(u.action != "none" for u in self.units)
            or self.installs
            or bool(self.repair)
            or bool(self.system_packages)
        )

    @property
    def installs(self) -> bool:
        """The bootstrap has work on this host (a package to install, upgrade or reinstall)."""
        return any(p.action != "none" for p in self.packages)


@dataclass(frozen=True)
class Plan:
    topology: str
    generation: str
    bpdkv_version: str
    compat_break: bool
    compat_changes: list[str]
    hosts: list[HostPlan]
    waves: list[Wave] = field(default_factory=list)
    cli_build: str = ""  # digest of the bpdkv source that made the plan; a saved plan runs only with the same build
    group: list[str] = field(default_factory=list)  # hosts of one P/D generation: they succeed or roll back together
    limit: list[str] = field(default_factory=list)
    roll: cohorts.RollPlan | None = None  # a compatibility break rolled cohort by cohort (bpdkv/deploy/cohorts.py)
    downtime: str = ""  # why no complete generation serves during this plan's restarts (apply needs --allow-downtime)

    @property
    def has_changes(self) -> bool:
        return any(h.changed for h in self.hosts)

    @property
    def has_errors(self) -> bool:
        return any((not h.reachable or h.problems) and not h.skipped for h in self.hosts)

    @property
    def problems(self) -> list[PreflightProblem]:
        out = [PreflightProblem(h.host, "reachable", h.error or "no facts") for h in self.hosts if not h.reachable and not h.skipped]
        return out + [p for h in self.hosts if not h.skipped for p in h.problems]

    @property
    def exit_code(self) -> int:
        """Like terraform plan -detailed-exitcode: 0 no changes, 2 changes, 1 error."""
        return 1 if self.has_errors else 2 if self.has_changes else 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(replace(self, roll=None))
        out["roll"] = self.roll.to_json() if self.roll is not None else None
        for host, plan in zip(out["hosts"], self.hosts, strict=True):
            for f in host["files"]:
                f["symbol"] = FileAction(f["action"]).symbol
            host["operations"] = [ops.to_json(op) for op in plan.operations]
            host["commands"] = [ops.describe(op) for op in plan.operations]
        out["has_changes"] = self.has_changes
        out["has_errors"] = self.has_errors
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> Plan:
        hosts = [
            HostPlan(
                host=h["host"],
                address=h["address"],
                reachable=h["reachable"],
                error=h["error"],
                files=[FileChange(f["path"], FileAction(f["action"]), f["mode"], f["instance"], f["drift"], f["diff"]) for f in h["files"]],
                daemon_reload=h["daemon_reload"],
                units=[
                    UnitAction(u["unit"], u["instance"], u["role"], UnitVerb(u["action"]), u["reason"], u["port"], u.get("new", False))
                    for u in h["units"]
                ],
                facts_digest=h["facts_digest"],
                packages=[PackageChange(p["name"], p["old"], p["new"], p["action"]) for p in h.get("packages", [])],
                operations=[ops.from_json(op) for op in h["operations"]],
                problems=[PreflightProblem(**p) for p in h.get("problems", [])],
                repair=h.get("repair"),
                skipped=h.get("skipped", False),
                system_packages=h.get("system_packages", []),
            )
            for h in data["hosts"]
        ]
        return Plan(
            data["topology"],
            data["generation"],
            data["bpdkv_version"],
            data["compat_break"],
            data["compat_changes"],
            hosts,
            [Wave(w["role"], WaveAction(w["action"]), list(w["units"])) for w in data["waves"]],
            data["cli_build"],
            data.get("group", []),
            data.get("limit", []),
            cohorts.RollPlan.from_json(data["roll"]) if data.get("roll") else None,
            data.get("downtime", ""),
        )


def generation_id(artifacts: list[Artifact]) -> str:
    h = hashlib.sha256()
    for art in sorted(artifacts, key=lambda a: (a.host, a.path)):
        h.update(f"{art.host}\0{art.path}\0{art.mode}\0".encode())
        h.update(art.content.encode())
    return h.hexdigest()[:12]


def facts_parts(facts: HostFacts) -> dict[str, str]:
    """What a saved plan depends on, one digest per kind of fact, so a refusal can say *what* changed on a host: a
    lock or dirty marker appearing, a file's content, mode or group, a unit state, a package, a service user's group."""
    parts = {
        "manifest": facts.manifest,
        "files": {p: (None if i is None else [i["sha256"], i.get("mode"), i.get("group")]) for p, i in sorted(facts.files.items())},
        "unit states": facts.units,
        "installed versions": [facts.versions, facts.bpdkv_source],
        "dirty marker": facts.dirty,
        "system packages": facts.debian,
        "service users": facts.user_groups,
    }
    owners = {p: i.get("owner") for p, i in sorted(facts.files.items()) if i is not None and i.get("owner") is not None}
    if owners:
        parts["file owners"] = owners
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in parts.items()}


def facts_detail(facts: HostFacts) -> dict[str, Any]:
    """What a saved plan keeps of one host's facts (no file content), so a refusal names each difference."""
    manifest = facts.manifest if isinstance(facts.manifest, dict) else None
    return {
        "files": {
            p: (None if i is None else {k: i.get(k) for k in ("sha256", "mode", "owner", "group")}) for p, i in sorted(facts.files.items())
        },
        "units": dict(facts.units),
        "versions": dict(facts.versions),
        "bpdkv_source": facts.bpdkv_source,
        "system packages": dict(facts.debian),
        "service users": dict(facts.user_groups),
        "lock": None if facts.lock is None else str(facts.lock.get("owner")),
        "dirty": facts.dirty,
        "manifest": None
        if facts.manifest is None
        else hashlib.sha256(json.dumps(facts.manifest, sort_keys=True).encode()).hexdigest()[:12],
        "generation": None if manifest is None else manifest.get("generation"),
    }


def fact_differences(host: str, before: dict[str, Any], facts: HostFacts) -> list[str]:
    """One line per difference between a saved plan's facts and the host's now: host, file or unit, what differs."""
    now = facts_detail(facts)
    out: list[str] = []
    old_files, new_files = before.get("files", {}), now["files"]
    for path in sorted(set(old_files) | set(new_files)):
        a, b = old_files.get(path), new_files.get(path)
        if a == b:
            continue
        if a is None:
            out.append(f"{host}: {path}: appeared (sha256 {str(b['sha256'])[:12]})")
            continue
        if b is None:
            out.append(f"{host}: {path}: removed")
            continue
        if a.get("sha256") != b.get("sha256"):
            out.append(f"{host}: {path}: content sha256 {str(a.get('sha256'))[:12]} → {str(b.get('sha256'))[:12]}")
        if a.get("mode") != b.get("mode"):
            out.append(f"{host}: {path}: mode {_mode(a.get('mode'))} → {_mode(b.get('mode'))}")
        for key in ("owner", "group"):
            if a.get(key) != b.get(key):
                out.append(f"{host}: {path}: {key} {a.get(key)} → {b.get(key)}")
    for unit in sorted(set(before.get("units", {})) | set(now["units"])):
        a, b = before.get("units", {}).get(unit), now["units"].get(unit)
        if a != b:
            out.append(f"{host}: unit {unit}: {a or 'unknown'} → {b or 'unknown'}")
    for name in sorted(set(before.get("versions", {})) | set(now["versions"])):
        a, b = before.get("versions", {}).get(name), now["versions"].get(name)
        if a != b:
            out.append(f"{host}: package {name}: {a or 'not installed'} → {b or 'not installed'}")
    if before.get("bpdkv_source") != now["bpdkv_source"]:
        out.append(f"{host}: bpdkv installed on the node: source {before.get('bpdkv_source')} → {now['bpdkv_source']}")
    for name in sorted(set(before.get("system packages", {})) | set(now["system packages"])):
        a, b = before.get("system packages", {}).get(name), now["system packages"].get(name)
        if a != b:
            out.append(f"{host}: Debian package {name}: {'installed' if a else 'missing'} → {'installed' if b else 'missing'}")
    for user in sorted(set(before.get("service users", {})) | set(now["service users"])):
        a, b = before.get("service users", {}).get(user), now["service users"].get(user)
        if a != b:
            out.append(f"{host}: service user {user}: group {a or 'no such user'} → {b or 'no such user'}")
    if before.get("lock") != now["lock"]:
        out.append(f"{host}: apply lock: {before.get('lock') or 'free'} → {now['lock'] or 'free'}")
    if before.get("dirty") != now["dirty"]:
        out.append(f"{host}: dirty marker: {before.get('dirty') or 'none'} → {now['dirty'] or 'none'}")
    if before.get("manifest") != now["manifest"]:
        out.append(f"{host}: manifest: generation {before.get('generation')} → {now['generation']} (another apply?)")
    return out


def _mode(value: Any) -> str:
    return f"{value:o}" if isinstance(value, int) else str(value)


def facts_digest(facts: HostFacts) -> str:
    """One digest of facts_parts: a saved plan runs only while it is unchanged."""
    return hashlib.sha256(json.dumps(facts_parts(facts), sort_keys=True).encode()).hexdigest()[:16]


def redact(text: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        key, sep, _ = line.partition("=")
        if sep and SECRET_KEY.search(key) and not key.lstrip().startswith("#"):
            out.append(f"{key}=<redacted>\n")
        else:
            out.append(line)
    return "".join(out)


def _diff(host: str, path: str, old: str | None, new: str | None, secret: bool) -> str:
    if secret:  # which lines changed (a rotation shows), never a value of either side
        return secret_diff(old or "", new or "", f"{host}:{path} (on host)", f"{host}:{path} (rendered)", path.endswith(".env"))
    a = redact(old or "") if secret else (old or "")
    b = redact(new or "") if secret else (new or "")
    lines = difflib.unified_diff(
        a.splitlines(keepends=True), b.splitlines(keepends=True), f"{host}:{path} (on host)", f"{host}:{path} (rendered)"
    )
    return "".join(lines)


def manifest_for(topology: Topology, host: str, artifacts: list[Artifact], generation: str) -> dict[str, Any]:
    return {
        "topology": topology.name,
        "bpdkv_version": __version__,
        "generation": generation,
        "node": host,
        "files": {a.path: hashlib.sha256(a.content.encode()).hexdigest() for a in artifacts if a.host == host},
        "units": sorted(a.unit for a in artifacts if a.host == host and a.unit),
        "instances": {a.unit: a.instance for a in artifacts if a.host == host and a.unit},
        "compat": compat_fingerprint(topology),
        # What the router must know of this generation while a roll moves away from it (cohort apply).
        "router_generation": router_generation(topology),
        # What the bootstrap installed, so destroy can take it away again.
        "packages": {"venv": topology.vllm.venv, "wheelhouse": NODE_WHEELHOUSE} if topology.bootstrap.enabled else None,
    }


def make_plan(
    topology: Topology,
    artifacts: list[Artifact],
    facts: dict[str, HostFacts],
    limit: tuple[str, ...] = (),
    owner: str | None = None,
    system_packages: dict[str, tuple[str, ...]] | None = None,
    start_timeout: float | None = None,
    max_unavailable: int = 1,
) -> Plan:
    """`limit`: node names or roles to act on (others are skipped, not checked); `owner`: this apply's lock owner, so a
    lock held by it is not a problem; `system_packages`: Debian packages the render asks for, per node;
    `max_unavailable`: P and D instances one cohort step of a roll may take out of service."""
    generation = generation_id(artifacts)
    desired_compat = compat_fingerprint(topology)
    selected = {n.name for n in topology.nodes if _selected(n, limit)}
    # Compatibility break: a P/D host's last manifest disagrees with what we are about to deploy. (A router's manifest
    # records the fleet's fingerprint too, but a router pairs nothing: after a roll stopped between its last cohort and
    # the router's manifest, only the P/D hosts say whether P and D still need to move.)
    engines = {n.name for n in topology.nodes if any(i.role in ("prefill", "decode") for i in n.instances)}
    compat_changes: list[str] = []
    for name, known in facts.items():
        if name not in engines:
            continue
        old = (known.manifest or {}).get("compat") if known.reachable else None
        if old:
            for key, value in desired_compat.items():
                if old.get(key) != value:
                    change = f"{key}: {old.get(key)} → {value}"
                    if change not in compat_changes:
                        compat_changes.append(change)
    compat_break = bool(compat_changes)
    router = _router(topology, facts)
    roll = None
    downtime = ""
    if compat_break and not limit:
        roll = _roll(topology, artifacts, facts, router, max_unavailable)
        if roll is not None and roll.downtime:
            counts = ", ".join(f"{n.name}: {_role_counts(n)}" for n in topology.nodes if _role_counts(n))
            downtime = (
                f"no cohort step keeps a P and a D serving ({counts}; no spare node): "
                "P and D restart together, clients get errors meanwhile — add a spare node or a P and a D"
            )
            roll = None
        elif roll is None and router is not None:
            downtime = "the break cannot be rolled cohort by cohort (a P/D node never deployed, or more than one older generation): P and D restart together"
    roll_step: dict[str, int] = {}  # node → the first cohort step it moves in (a spare: its surge, not its retire)
    for k, step in enumerate(roll.steps if roll else (), 1):
        for name in step.step.nodes:
            roll_step.setdefault(name, k)

    instances = {i.name: (n, i) for n, i in topology.instances()}
    host_plans: list[HostPlan] = []
    restarted_prefill: list[str] = []
    pending: list[tuple[Node, list[FileChange], bool, list[UnitAction], HostFacts, list[PackageChange], str | None]] = []

    for node in topology.nodes:
        f = facts.get(node.name)
        mine = [a for a in artifacts if a.host == node.name]
        if node.name not in selected:
            host_plans.append(HostPlan(node.name, node.host, f is not None and f.reachable, None, [], False, [], "", skipped=True))
            continue
        if f is None or not f.reachable:
            host_plans.append(HostPlan(node.name, node.host, False, f.error if f else "no facts", [], False, [], ""))
            continue
        manifest_files: dict[str, str] = (f.manifest or {}).get("files", {}) if isinstance(f.manifest, dict) else {}
        changes: list[FileChange] = []
        changed_by_instance: dict[str, list[str]] = {}
        reloaded_by_instance: dict[str, list[str]] = {}
        for art in sorted(mine, key=lambda a: a.path):
            info = f.files.get(art.path)
            want = hashlib.sha256(art.content.encode()).hexdigest()
            recorded = manifest_files.get(art.path)
            # Drift: edited on the host. A file that is already what we render (an unfinished apply committed it before
            # its record) is not an edit: the repair line says the record is behind.
            drift = info is not None and recorded is not None and info["sha256"] != recorded and info["sha256"] != want
            if drift and art.path.endswith(".router.yaml") and (compat_break or _behind(f, desired_compat)) and _reloadable(f, art):
                drift = False  # a roll wrote it (it differs only in the upstreams and generations a roll changes)
            if info is None:
                action = FileAction.CREATE
            elif info["sha256"] != want or info.get("mode") != art.mode or _wrong_group(f, art, info):
                action = FileAction.UPDATE
            else:
                action = FileAction.NONE
            diff = _diff(node.name, art.path, f.content(art.path), art.content, art.secret) if action == "update" else ""
            changes.append(FileChange(art.path, action, art.mode, art.instance, drift, diff))
            if action != "none" and art.instance:  # a reloaded file (TLS pair) needs no restart: the instance re-reads it
                by_instance = reloaded_by_instance if art.reloaded else changed_by_instance
                by_instance.setdefault(art.instance, []).append(_kind(art.path))
        rendered = {a.path for a in mine}
        for path in sorted(manifest_files):
            if path not in rendered and path != MANIFEST_PATH:
                changes.append(FileChange(path, FileAction.DELETE, 0, None, False, ""))
        repair = _repair_reason(f, mine)
        packages = package_changes(topology, node, f.versions, f.bpdkv_source)
        upgraded = [p.line for p in packages if p.action != "none"]
        units: list[UnitAction] = []
        for art in sorted((a for a in mine if a.unit), key=lambda a: a.path):
            assert art.unit and art.instance
            _, inst = instances[art.instance]
            state = f.units.get(art.unit, "inactive")
            what = changed_by_instance.get(art.instance)
            new = any(c.path == art.path and c.action == "create" for c in changes)
            if node.spare and inst.role in ("prefill", "decode") and roll is not None and node.name in roll_step:
                verb = UnitVerb.RESTART if state == "active" else UnitVerb.START
                reason = f"surge: the new generation on spare capacity, cohort step {roll_step[node.name]} of {len(roll.steps)}"
            elif node.spare and inst.role in ("prefill", "decode"):
                verb, reason = (
                    (UnitVerb.STOP, "spare: runs only during a roll")
                    if state == "active"
                    else (UnitVerb.NONE, "spare: runs only during a roll")
                )
            elif new:
                verb, reason = UnitVerb.START, "new instance"
            elif roll is not None and inst.role in ("prefill", "decode") and node.name in roll.adopted:
                verb = UnitVerb.NONE if state == "active" else UnitVerb.START
                reason = f"runs vLLM {roll.new_vllm} already (its engine says so): the roll stopped before this node's record"
            elif roll is not None and inst.role in ("prefill", "decode") and node.name in roll_step:
                verb = UnitVerb.RESTART if state == "active" else UnitVerb.START
                reason = f"compatibility break ({'; '.join(compat_changes)}): cohort step {roll_step[node.name]} of {len(roll.steps)}"
            elif (
                (roll is not None or _behind(f, desired_compat))
                and inst.role == "router"
                and _router_rides_the_roll(f, mine, inst.name, what or [], topology)
            ):
                verb, reason = UnitVerb.NONE, "re-reads its upstreams and generations (the roll writes them step by step)"
                if "launch script" in (what or []):
                    reason += "; its launch script changed only in the venv it runs from (the same bpdkv build): used at its next restart"
            elif compat_break and roll is None and inst.role in ("prefill", "decode"):
                verb, reason = UnitVerb.RESTART, "compatibility break (" + "; ".join(compat_changes) + "): P and D restart together"
            elif what:
                verb, reason = (UnitVerb.RESTART if state == "active" else UnitVerb.START), "changed: " + ", ".join(sorted(set(what)))
            elif upgraded:
                verb, reason = (UnitVerb.RESTART if state == "active" else UnitVerb.START), "packages changed: " + "; ".join(upgraded)
            elif repair:
                verb, reason = (UnitVerb.RESTART if state == "active" else UnitVerb.START), f"repair: {repair}"
            elif state != "active":
                verb, reason = UnitVerb.START, f"not running ({state})"
            elif art.instance in reloaded_by_instance:
                kinds = ", ".join(sorted(set(reloaded_by_instance[art.instance])))
                verb, reason = UnitVerb.NONE, f"re-reads its changed {kinds} without a restart"
            else:
                verb, reason = UnitVerb.NONE, "up to date"
            if inst.role == "prefill" and verb in (UnitVerb.RESTART, UnitVerb.START) and not new:
                restarted_prefill.append(inst.name)
            units.append(UnitAction(art.unit, inst.name, inst.role, verb, reason, inst.port, new))
        old_units = (f.manifest or {}).get("units", []) if isinstance(f.manifest, dict) else []
        old_instances = (f.manifest or {}).get("instances", {}) if isinstance(f.manifest, dict) else {}
        for unit in old_units:
            if unit not in {a.unit for a in mine if a.unit}:
                units.append(UnitAction(unit, old_instances.get(unit, unit), "removed", UnitVerb.STOP, "no longer in the topology"))
        daemon_reload = any(c.path.endswith(".service") and c.action != "none" for c in changes)
        pending.append((node, changes, daemon_reload, units, f, packages, repair))

    for node, changes, daemon_reload, units, host_facts, packages, repair in pending:
        # D instances that talk to a restarted P restart after it: their NIXL agents cache P's metadata. In a roll, every
        # P/D node restarts in its own cohort step, and a D never talks to a P of the other generation.
        if restarted_prefill and roll is None:
            units = [
                UnitAction(
                    u.unit,
                    u.instance,
                    u.role,
                    UnitVerb.RESTART,
                    f"prefill {', '.join(restarted_prefill)} restarts (stale NIXL agent cache on D)",
                    u.port,
                )
                if u.role == "decode" and u.action == "none"
                else u
                for u in units
            ]
        mine = [a for a in artifacts if a.host == node.name]
        missing = [p for p in (system_packages or {}).get(node.name, ()) if not host_facts.debian.get(p)]
        host_plan = HostPlan(
            node.name,
            node.host,
            True,
            None,
            changes,
            daemon_reload,
            units,
            facts_digest(host_facts),
            packages,
            repair=repair,
            system_packages=missing,
        )
        operations = host_operations(topology, node, host_plan, mine, generation, tuple(missing), router, start_timeout)
        if roll is not None and node.name in roll_step:
            # The roll undrains a node's instances only once the router serves them in the new generation (the step's).
            operations = [op for op in operations if not isinstance(op, ops.Undrain)]
        problems = preflight_problems(node, host_facts, mine, host_plan, owner)
        host_plans.append(replace(host_plan, operations=operations if host_plan.changed else [], problems=problems))

    host_plans.sort(key=lambda h: [n.name for n in topology.nodes].index(h.host))
    host_plans = with_probe_pulls(topology, artifacts, host_plans)
    host_plans = with_link_measurements(topology, host_plans)
    waves: list[Wave] = []
    stops = [f"{h.host}:{u.unit}" for h in host_plans for u in h.units if u.action == "stop"]
    if stops:
        waves.append(Wave("removed", WaveAction.STOP, stops))
    for role in ROLE_ORDER:
        members = [f"{h.host}:{u.unit}" for h in host_plans for u in h.units if u.role == role and u.action in ("start", "restart")]
        if members:
            waves.append(Wave(role, WaveAction.START_OR_RESTART, members))
    group = sorted(
        {h.host for h in host_plans for u in h.units if compat_break and u.role in ("prefill", "decode") and u.action != "none"},
        key=[n.name for n in topology.nodes].index,
    )
    if roll is not None:
        group = []  # a roll fails and rolls back cohort by cohort, never the whole fleet
    return Plan(
        topology.name,
        generation,
        __version__,
        compat_break,
        compat_changes,
        host_plans,
        waves,
        source_digest(),
        group,
        list(limit),
        roll,
        downtime,
    )


def _role_counts(node: Node) -> str:
    roles = [i.role for i in node.instances]
    parts = [f"{roles.count(r)} {r[0].upper()}" for r in ("prefill", "decode") if roles.count(r)]
    return " + ".join(parts)


ROLL_KEYS = contracts.ROUTER_RELOADABLE_KEYS  # what the router re-reads without a restart


def _behind(facts: HostFacts, desired: dict[str, Any]) -> bool:
    """The host's manifest records another compatibility fingerprint (a router whose roll stopped before its record)."""
    manifest = facts.manifest if isinstance(facts.manifest, dict) else {}
    return bool(manifest.get("compat")) and manifest.get("compat") != desired


def _router_rides_the_roll(facts: HostFacts, mine: list[Artifact], instance: str, what: list[str], topology: Topology) -> bool:
    """A router whose files change in a roll only in what it re-reads (its upstreams and generations) and, where each
    release has its own vllm.venv, in the venv path of its launch script: that venv gets the same bpdkv build, so the
    running router needs no restart (a restart would cut its clients' requests)."""
    kinds = set(what)
    if not kinds <= {"router config", "launch script"}:
        return False
    for art in mine:
        if art.instance != instance:
            continue
        if art.path.endswith(".router.yaml") and "router config" in kinds and not _reloadable(facts, art):
            return False
        if art.path.endswith(".sh") and "launch script" in kinds:
            old_venv = ((facts.manifest or {}).get("packages") or {}).get("venv") if isinstance(facts.manifest, dict) else None
            old = facts.content(art.path)
            if not old_venv or old is None or old.replace(old_venv + "/", topology.vllm.venv + "/") != art.content:
                return False
    return True


def _reloadable(facts: HostFacts, art: Artifact) -> bool:
    """The router config changes only in what the router re-reads (upstreams, generations)."""
    import yaml

    try:
        old = yaml.safe_load(facts.content(art.path) or "")
        new = yaml.safe_load(art.content)
    except yaml.YAMLError:
        return False
    if not isinstance(old, dict) or not isinstance(new, dict):
        return False
    return {k: v for k, v in old.items() if k not in ROLL_KEYS} == {k: v for k, v in new.items() if k not in ROLL_KEYS}


def _roll(
    topology: Topology, artifacts: list[Artifact], facts: dict[str, HostFacts], router: tuple[str, int] | None, max_unavailable: int
) -> cohorts.RollPlan | None:
    """A compatibility break as cohort steps (bpdkv/deploy/cohorts.py), or None: P and D restart together."""
    if router is None:
        return None
    manifests = {
        n.name: (f.manifest if isinstance(f.manifest, dict) else None)
        for n in topology.nodes
        for f in [facts.get(n.name)]
        if f and f.reachable
    }
    admin_base = router_base(topology.router, "127.0.0.1", router[1])
    key_file = _admin_key_file(topology)
    undrains = {
        n.name: [ops.Undrain(i.name, router[0], router[1], admin_base, key_file) for i in n.instances if i.role in ("prefill", "decode")]
        for n in topology.nodes
    }
    running_new = frozenset(n.name for n in topology.nodes if n.name in facts and runs_new_release(topology, n, facts[n.name], artifacts))
    return cohorts.build_roll(topology, artifacts, manifests, router, admin_base, key_file, max_unavailable, undrains, running_new)


def _release(version: str | None) -> str:
    return (version or "").split("+", 1)[0].strip()


def runs_new_release(topology: Topology, node: Node, facts: HostFacts, artifacts: list[Artifact]) -> bool:
    """The node's engines already run the topology's release while its manifest records another: every P/D engine
    answers /version with the new release and every file of the node on disk is the rendered one (a killed apply
    committed and restarted it, then stopped before its record). Only a release change can be seen from outside: for a
    break that keeps the release (model, dtype, block size) the node is moved again."""
    manifest = facts.manifest if isinstance(facts.manifest, dict) else {}
    old = (manifest.get("compat") or {}).get("vllm")
    new = topology.vllm.version
    if not facts.reachable or not old or _release(old) == _release(new) or manifest.get("compat") == compat_fingerprint(topology):
        return False
    units = [i.unit for i in node.instances if i.role in ("prefill", "decode")]
    if not units or any(_release(facts.engines.get(u)) != _release(new) for u in units):
        return False
    for art in artifacts:
        if art.host != node.name:
            continue
        info = facts.files.get(art.path)
        if info is None or info.get("sha256") != hashlib.sha256(art.content.encode()).hexdigest():
            return False
    return True


def _selected(node: Node, limit: tuple[str, ...]) -> bool:
    return not limit or node.name in limit or any(i.role in limit for i in node.instances)


def _router(topology: Topology, facts: dict[str, HostFacts]) -> tuple[str, int] | None:
    """Where a running router listens (node name, port): rolling restarts drain through it. None when the topology
    has no router or it does not run yet (nothing to drain)."""
    for node, inst in topology.instances():
        if inst.role == "router" and inst.port is not None:
            known = facts.get(node.name)
            if known is not None and known.reachable and known.units.get(inst.unit) == "active":
                return node.name, inst.port
    return None


def _repair_reason(facts: HostFacts, mine: list[Artifact]) -> str | None:
    """A host whose record disagrees with its files did not finish an apply: say so, so plan and status agree."""
    if facts.dirty:
        return f"a previous apply could not restore this host ({facts.dirty})"
    if not mine:
        return None
    manifest = facts.manifest if isinstance(facts.manifest, dict) else None
    if manifest is None:
        present = [a.path for a in mine if facts.files.get(a.path) is not None]
        return "files present but no valid manifest (unfinished apply)" if present else None
    recorded = manifest.get("files", {})
    for art in mine:
        info = facts.files.get(art.path)
        want = hashlib.sha256(art.content.encode()).hexdigest()
        if info is not None and info["sha256"] == want and recorded.get(art.path) not in (None, want):
            return f"the manifest records another version of {art.path} (unfinished apply)"
    return None


def host_operations(
    topology: Topology,
    node: Node,
    plan: HostPlan,
    artifacts: list[Artifact],
    generation: str,
    system_packages: tuple[str, ...],
    router: tuple[str, int] | None,
    start_timeout: float | None,
) -> list[ops.Operation]:
    """The host's ordered operations: lock, packages, stops, staging, files, commit, daemon-reload, per unit (drain, start,
    gate, undrain), manifest, clean-up, unlock (ops.stage_operations frames them)."""
    out: list[ops.Operation] = []
    if system_packages:
        out.append(ops.InstallSystemPackages(system_packages))
    if plan.installs:
        lines = tuple(p.line for p in plan.packages if p.action != "none")
        out.append(ops.InstallPackages(lines, topology.vllm.venv, source_digest()))
    for u in plan.units:
        if u.action == "stop":
            out.append(ops.StopUnit(u.unit, u.instance, u.reason))
    by_path = {a.path: a for a in artifacts}
    for f in plan.files:
        if f.action in ("create", "update"):
            art = by_path[f.path]
            digest = hashlib.sha256(art.content.encode()).hexdigest()
            out.append(ops.UploadFile(f.path, art.mode, digest, art.secret, art.instance, art.reader))
        elif f.action == "delete":
            out.append(ops.DeleteFile(f.path))
    if plan.daemon_reload:
        out.append(ops.DaemonReload())
    timeout = start_timeout or float(topology.vllm.start_timeout)
    efa = node.efa_devices > 0 and topology.kv_transfer.backend == "LIBFABRIC"
    for role in ROLE_ORDER:
        for u in plan.units:
            if u.role != role or u.action not in ("start", "restart"):
                continue
            # Drain only what serves traffic through a router that runs already (a new router has nothing to drain).
            drain = router is not None and role in ("prefill", "decode") and u.action == "restart"
            admin = (router_base(topology.router, "127.0.0.1", router[1]), _admin_key_file(topology)) if router else ("", None)
            if drain:
                assert router is not None
                out.append(ops.Drain(u.instance, router[0], router[1], *admin))
            out.append(ops.StartUnit(u.unit, u.instance, u.role, u.action == "restart", u.new, u.reason))
            if u.port is not None:
                listen = topology.router.listen if role == "router" else ""
                address = listen if listen not in ("", "0.0.0.0", "::", "localhost") else "127.0.0.1"
                base, paths = health_probe(role, topology.router, address, u.port)  # HTTPS / keyed routers
                efa_check = efa and role in ("prefill", "decode")
                out.append(ops.HealthGate(u.unit, u.instance, address, u.port, timeout, efa_check, base, tuple(paths)))
            if drain:
                assert router is not None
                out.append(ops.Undrain(u.instance, router[0], router[1], *admin))
    manifest = manifest_for(topology, node.name, artifacts, generation)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    out.append(ops.WriteManifest(generation, digest, json.dumps(manifest, indent=2, sort_keys=True) + "\n"))
    return ops.stage_operations(generation, topology.name, out)


def _admin_key_file(topology: Topology) -> str | None:
    value = getattr(topology.router, "admin_key_file", None)
    return value if isinstance(value, str) else None


LINK_MEASURE_TIMEOUT = 300.0  # seconds for one P's measurement of all its links


def with_link_measurements(topology: Topology, hosts: list[HostPlan]) -> list[HostPlan]:
    """Issue 45 item 3: when the plan starts or restarts a P or a D (a new pair, release or route), each prefill
    instance measures its links to every decode instance after the gates (bpdkv/deploy/linkseed.py), placed before the
    manifest of P's host. Wherever P can read a seed: bpdkv's connector with reuse on (with `pull_decision: threshold`
    P pulls by token count, but the measured links are still what `status` shows, and the seed is there for a switch)."""
    kv = topology.kv_transfer
    if kv.connector != "bpdkv" or not kv.bidirectional:
        return hosts
    started = {op.instance for hp in hosts for op in hp.operations if isinstance(op, ops.StartUnit) and op.role in ("prefill", "decode")}
    prefills, decodes = topology.instances("prefill"), topology.instances("decode")
    if not started or not prefills or not decodes:
        return hosts
    python = f"{topology.vllm.venv}/bin/python"
    pairs = [(d_inst.name, f"http://{d_node.data_plane_address}:{d_inst.port}") for d_node, d_inst in decodes]
    by_host: dict[str, list[ops.MeasureLinks]] = {}
    for p_node, p_inst in prefills:
        sizes = linkseed.probe_sizes(p_inst.block_size, kv.kv_recompute_threshold, topology.model.max_model_len or 8192)
        command = linkseed.command(
            python, p_inst.name, f"http://127.0.0.1:{p_inst.port}", pairs, topology.model.served_name, sizes, LINK_MEASURE_TIMEOUT
        )
        op = ops.MeasureLinks(p_inst.name, p_node.name, tuple(name for name, _ in pairs), command, LINK_MEASURE_TIMEOUT)
        by_host.setdefault(p_node.name, []).append(op)
    out: list[HostPlan] = []
    for hp in hosts:
        kept: list[ops.Operation] = [op for op in hp.operations if not isinstance(op, ops.MeasureLinks)]
        measures = by_host.get(hp.host, [])
        at = next((i for i, op in enumerate(kept) if isinstance(op, ops.WriteManifest)), None)
        if measures and at is not None:
            kept[at:at] = measures
        out.append(replace(hp, operations=kept))
    return out


def with_probe_pulls(topology: Topology, artifacts: list[Artifact], hosts: list[HostPlan]) -> list[HostPlan]:
    """EFA fleets: one probe pull per decode instance whose gate checks EFA (with the first prefill), or, when only P
    instances do, per such P (with the first decode), each placed before the manifest of the host it blames."""
    placed = {i.name: (n, i) for n, i in topology.instances()}
    gated = {op.instance for hp in hosts for op in hp.operations if isinstance(op, ops.HealthGate) and op.efa_check}
    prefills = [i.name for _, i in topology.instances("prefill")]
    decodes = [i.name for _, i in topology.instances("decode")]
    pairs: set[tuple[str, str]] = set()
    for name in gated:
        if name in decodes and prefills:
            pairs.add((prefills[0], name))
        elif name in prefills and decodes and not any(d in gated for d in decodes):
            pairs.add((name, decodes[0]))
    length = efa_probe.probe_length(topology.kv_transfer.kv_recompute_threshold, topology.model.max_model_len or 0)
    python = f"{topology.vllm.venv}/bin/python"
    by_host: dict[str, list[ops.ProbePull]] = {}
    for p_name, d_name in sorted(pairs):
        (p_node, p_inst), (d_node, d_inst) = placed[p_name], placed[d_name]
        d_unit = next(a.unit for a in artifacts if a.instance == d_name and a.unit)  # also when D did not restart
        command = efa_probe.probe_command(
            python, f"http://127.0.0.1:{p_inst.port}", f"http://{d_node.data_plane_address}:{d_inst.port}", length, PROBE_TIMEOUT
        )
        blamed = d_node.name if d_name in gated else p_node.name
        op = ops.ProbePull(p_name, d_name, p_node.name, d_node.name, command, efa_probe.process_command(d_unit), PROBE_TIMEOUT)
        by_host.setdefault(blamed, []).append(op)
    out: list[HostPlan] = []
    for hp in hosts:
        kept: list[ops.Operation] = [op for op in hp.operations if not isinstance(op, ops.ProbePull)]
        probes = by_host.get(hp.host, [])
        if probes:
            at = next(i for i, op in enumerate(kept) if isinstance(op, ops.WriteManifest))
            kept[at:at] = probes
        out.append(replace(hp, operations=kept))
    return out


def _wrong_group(facts: HostFacts, art: Artifact, info: dict[str, Any]) -> bool:
    """A secret file its service user must read, whose group is not (or no longer: vllm.user changed) that user's."""
    return bool(art.reader) and "group" in info and art.reader in facts.user_groups and info["group"] != facts.user_groups[art.reader]


def preflight_problems(
    node: Node, facts: HostFacts, artifacts: list[Artifact], plan: HostPlan, owner: str | None
) -> list[PreflightProblem]:
    """Pure checks of one host's facts before anything is written anywhere: lock, disk, ports (hardware: see runner)."""
    problems: list[PreflightProblem] = []
    lock = facts.lock
    if lock and lock.get("owner") != owner:
        problems.append(
            PreflightProblem(
                node.name,
                "lock",
                f"another apply holds the lock: {lock.get('owner')} (pid {lock.get('pid')}, since {lock.get('started')}, "
                f"topology {lock.get('topology')}); wait for it or pass --force-unlock if it died",
            )
        )
    problems += disk_problems(node, facts, artifacts, plan)
    for user in sorted({a.reader for a in artifacts if a.reader}):
        if user in facts.user_groups and facts.user_groups[user] is None:
            problems.append(
                PreflightProblem(node.name, "user", f"user {user} (vllm.user) does not exist on this host; create it or change vllm.user")
            )
    starting = {u.port: u for u in plan.units if u.port is not None and u.action in ("start", "restart")}
    for listener in facts.listeners:
        unit = starting.get(listener.port)
        if unit is None:
            continue
        ours = facts.units.get(unit.unit) == "active" or any(
            u.port == listener.port and facts.units.get(u.unit) == "active" for u in plan.units
        )
        if not ours:
            who = f"{listener.process} (pid {listener.pid})" if listener.process else "another process"
            problems.append(
                PreflightProblem(
                    node.name, "ports", f"port {listener.port} for {unit.instance} is taken by {who}; free it or change the port"
                )
            )
    return problems


def disk_problems(node: Node, facts: HostFacts, artifacts: list[Artifact], plan: HostPlan) -> list[PreflightProblem]:
    """Every folder the commit writes, measured against what it will write there, per file system (folders on one file
    system share its free space): the staged copies beside their targets, the backups of the files replaced or deleted
    (BACKUP_DIR), the manifest and its staged copy, the dirty marker, plus DISK_MARGIN. A read-only one is refused too.
    Refused here, before any write on any host: the commit never starts on a disk it cannot finish on."""
    changing = [f for f in plan.files if f.action != "none"]
    if not changing:
        return []
    spaces = {d.path: d for d in facts.disk}
    sizes = {a.path: len(a.content.encode()) for a in artifacts}

    def space_of(path: str) -> DiskSpace | None:
        folder = path.rsplit("/", 1)[0] or "/"
        return spaces.get(folder)

    need: dict[str, int] = {}  # mount point -> bytes
    parts: dict[str, dict[str, int]] = {}
    where: dict[str, DiskSpace] = {}

    def add(space: DiskSpace | None, kind: str, size: int) -> None:
        if space is None:
            return
        key = space.mount or space.path
        where.setdefault(key, space)
        need[key] = need.get(key, 0) + size
        parts.setdefault(key, {})[kind] = parts.get(key, {}).get(kind, 0) + size

    backup = spaces.get(BACKUP_DIR)
    for f in changing:
        info = facts.files.get(f.path)
        old = int(info.get("size") or 0) if isinstance(info, dict) else 0
        if f.action in ("create", "update"):
            add(space_of(f.path), "staged files", sizes.get(f.path, 0))
        if f.action in ("update", "delete") and info is not None:
            add(backup, "backups", old)
            add(space_of(f.path), "restore copies", old)  # a restore copies the backup beside the file, then renames
    # The manifest (its staged copy, then renamed) and the dirty marker: a path and a digest per file, and a little more.
    add(space_of(MANIFEST_PATH), "manifest", 2 * (4096 + sum(len(a.path) + 96 for a in artifacts)))
    out: list[PreflightProblem] = []
    said: set[str] = set()
    for space in facts.disk:
        if space.read_only and space.path not in said:
            said.add(space.path)
            out.append(PreflightProblem(node.name, "disk", f"{space.path} is on a read-only file system; remount it read-write"))
    for key, total in sorted(need.items()):
        space = where[key]
        want = total + DISK_MARGIN
        if space.free_bytes < want:
            folders = sorted(d.path for d in facts.disk if (d.mount or d.path) == key)
            what = ", ".join(f"{kind} {size}" for kind, size in sorted(parts[key].items()))
            out.append(
                PreflightProblem(
                    node.name,
                    "disk",
                    f"{', '.join(folders)}: {space.free_bytes} bytes free, need at least {want} ({what}, margin {DISK_MARGIN}); "
                    "free space first",
                )
            )
    return out


def _kind(path: str) -> str:
    if path.endswith(".service"):
        return "unit"
    if path.endswith(".env"):
        return "env"
    if path.endswith(".sh"):
        return "launch script"
    if path.endswith(".router.yaml"):
        return "router config"
    if path.endswith(".tls.crt"):
        return "TLS certificate"
    if path.endswith(".tls.key"):
        return "TLS key"
    return path


def empty_facts(topology: Topology) -> dict[str, HostFacts]:
    """--offline: every host as if empty (everything is created)."""
    return {n.name: HostFacts(node=n.name, reachable=True) for n in topology.nodes}
