"""Facts + rendered artifacts → Plan. Pure: no network, no clock (golden/fixture testable, like pyinfra's operations)."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bpdkv import __version__
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import PackageChange, package_changes, source_digest
from bpdkv.deploy.facts import MANIFEST_PATH, NODE_WHEELHOUSE, HostFacts, PreflightProblem
from bpdkv.render import Artifact
from bpdkv.secrets import secret_diff
from bpdkv.topology.model import Node, Topology

SECRET_KEY = re.compile(r"(?i)(key|token|secret|passw|credential|auth)")
ROLE_ORDER = ("prefill", "decode", "router")
DISK_MARGIN = 16 * 1024 * 1024  # bytes free beyond the files themselves (backups, temp copies, the manifest)


@dataclass(frozen=True)
class FileChange:
    path: str
    action: str  # create | update | delete | none
    mode: int
    instance: str | None
    drift: bool = False  # the file differs from what the last apply wrote (edited by hand)
    diff: str = ""

    @property
    def symbol(self) -> str:
        return {"create": "+", "update": "~", "delete": "-", "none": " "}[self.action]


@dataclass(frozen=True)
class UnitAction:
    unit: str
    instance: str
    role: str
    action: str  # start | restart | stop | none
    reason: str
    port: int | None = None


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
    waves: list[dict[str, Any]] = field(default_factory=list)
    cli_build: str = ""  # digest of the bpdkv source that made the plan; a saved plan runs only with the same build
    group: list[str] = field(default_factory=list)  # hosts of one P/D generation: they succeed or roll back together
    limit: list[str] = field(default_factory=list)

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
        out = asdict(self)
        for host, plan in zip(out["hosts"], self.hosts, strict=True):
            for f in host["files"]:
                f["symbol"] = {"create": "+", "update": "~", "delete": "-", "none": " "}[f["action"]]
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
                files=[FileChange(f["path"], f["action"], f["mode"], f["instance"], f["drift"], f["diff"]) for f in h["files"]],
                daemon_reload=h["daemon_reload"],
                units=[UnitAction(u["unit"], u["instance"], u["role"], u["action"], u["reason"], u["port"]) for u in h["units"]],
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
            data["waves"],
            data["cli_build"],
            data.get("group", []),
            data.get("limit", []),
        )


def compat_fingerprint(topology: Topology) -> dict[str, Any]:
    """What P and D must agree on; a change restarts all of them together as one generation."""
    return {
        "model": topology.model.id,
        "vllm": topology.vllm.version,
        "vllm_package": topology.vllm.package,
        "dtype": topology.model.dtype,
        "kv_cache_dtype": sorted({i.kv_cache_dtype for _, i in topology.instances() if i.role != "router"}),
        "block_size": sorted({i.block_size for _, i in topology.instances() if i.role != "router"}),
        "connector": topology.kv_transfer.connector,
    }


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
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in parts.items()}


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
) -> Plan:
    """`limit`: node names or roles to act on (others are skipped, not checked); `owner`: this apply's lock owner, so a
    lock held by it is not a problem; `system_packages`: Debian packages the render asks for, per node."""
    generation = generation_id(artifacts)
    desired_compat = compat_fingerprint(topology)
    selected = {n.name for n in topology.nodes if _selected(n, limit)}
    # Compatibility break: any host's last manifest disagrees with what we are about to deploy.
    compat_changes: list[str] = []
    for known in facts.values():
        old = (known.manifest or {}).get("compat") if known.reachable else None
        if old:
            for key, value in desired_compat.items():
                if old.get(key) != value:
                    change = f"{key}: {old.get(key)} → {value}"
                    if change not in compat_changes:
                        compat_changes.append(change)
    compat_break = bool(compat_changes)

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
            drift = info is not None and recorded is not None and info["sha256"] != recorded
            if info is None:
                action = "create"
            elif info["sha256"] != want or info.get("mode") != art.mode or _wrong_group(f, art, info):
                action = "update"
            else:
                action = "none"
            diff = _diff(node.name, art.path, f.content(art.path), art.content, art.secret) if action == "update" else ""
            changes.append(FileChange(art.path, action, art.mode, art.instance, drift, diff))
            if action != "none" and art.instance:  # a reloaded file (TLS pair) needs no restart: the instance re-reads it
                by_instance = reloaded_by_instance if art.reloaded else changed_by_instance
                by_instance.setdefault(art.instance, []).append(_kind(art.path))
        rendered = {a.path for a in mine}
        for path in sorted(manifest_files):
            if path not in rendered and path != MANIFEST_PATH:
                changes.append(FileChange(path, "delete", 0, None, False, ""))
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
            if new:
                action, reason = "start", "new instance"
            elif compat_break and inst.role in ("prefill", "decode"):
                action, reason = "restart", "compatibility break (" + "; ".join(compat_changes) + "): P and D restart together"
            elif what:
                action, reason = ("restart" if state == "active" else "start"), "changed: " + ", ".join(sorted(set(what)))
            elif upgraded:
                action, reason = ("restart" if state == "active" else "start"), "packages changed: " + "; ".join(upgraded)
            elif repair:
                action, reason = ("restart" if state == "active" else "start"), f"repair: {repair}"
            elif state != "active":
                action, reason = "start", f"not running ({state})"
            elif art.instance in reloaded_by_instance:
                kinds = ", ".join(sorted(set(reloaded_by_instance[art.instance])))
                action, reason = "none", f"re-reads its changed {kinds} without a restart"
            else:
                action, reason = "none", "up to date"
            if inst.role == "prefill" and action in ("restart", "start") and not new:
                restarted_prefill.append(inst.name)
            units.append(UnitAction(art.unit, inst.name, inst.role, action, reason, inst.port))
        old_units = (f.manifest or {}).get("units", []) if isinstance(f.manifest, dict) else []
        old_instances = (f.manifest or {}).get("instances", {}) if isinstance(f.manifest, dict) else {}
        for unit in old_units:
            if unit not in {a.unit for a in mine if a.unit}:
                units.append(UnitAction(unit, old_instances.get(unit, unit), "removed", "stop", "no longer in the topology"))
        daemon_reload = any(c.path.endswith(".service") and c.action != "none" for c in changes)
        pending.append((node, changes, daemon_reload, units, f, packages, repair))

    router = _router(topology, facts)
    for node, changes, daemon_reload, units, host_facts, packages, repair in pending:
        # D instances that talk to a restarted P restart after it: their NIXL agents cache P's metadata.
        if restarted_prefill:
            units = [
                UnitAction(
                    u.unit,
                    u.instance,
                    u.role,
                    "restart",
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
        problems = preflight_problems(node, host_facts, mine, host_plan, owner)
        host_plans.append(replace(host_plan, operations=operations if host_plan.changed else [], problems=problems))

    host_plans.sort(key=lambda h: [n.name for n in topology.nodes].index(h.host))
    waves: list[dict[str, Any]] = []
    stops = [f"{h.host}:{u.unit}" for h in host_plans for u in h.units if u.action == "stop"]
    if stops:
        waves.append({"role": "removed", "action": "stop", "units": stops})
    for role in ROLE_ORDER:
        members = [f"{h.host}:{u.unit}" for h in host_plans for u in h.units if u.role == role and u.action in ("start", "restart")]
        if members:
            waves.append({"role": role, "action": "start/restart", "units": members})
    group = sorted(
        {h.host for h in host_plans for u in h.units if compat_break and u.role in ("prefill", "decode") and u.action != "none"},
        key=[n.name for n in topology.nodes].index,
    )
    return Plan(
        topology.name, generation, __version__, compat_break, compat_changes, host_plans, waves, source_digest(), group, list(limit)
    )


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
    """The host's ordered operations: packages, stops, files, daemon-reload, per unit (drain, start, gate, undrain), manifest."""
    out: list[ops.Operation] = []
    if system_packages:
        out.append(ops.InstallSystemPackages(system_packages))
    if plan.installs:
        out.append(ops.InstallPackages(tuple(p.line for p in plan.packages if p.action != "none")))
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
            new = u.reason == "new instance"
            # Drain only what serves traffic through a router that runs already (a new router has nothing to drain).
            drain = router is not None and role in ("prefill", "decode") and u.action == "restart"
            if drain:
                assert router is not None
                out.append(ops.Drain(u.instance, router[0], router[1]))
            out.append(ops.StartUnit(u.unit, u.instance, u.role, u.action == "restart", new, u.reason))
            if u.port is not None:
                listen = topology.router.listen if role == "router" else ""
                address = listen if listen not in ("", "0.0.0.0", "::", "localhost") else "127.0.0.1"
                out.append(ops.HealthGate(u.unit, u.instance, address, u.port, timeout, efa and role in ("prefill", "decode")))
            if drain:
                assert router is not None
                out.append(ops.Undrain(u.instance, router[0], router[1]))
    manifest = manifest_for(topology, node.name, artifacts, generation)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    out.append(ops.WriteManifest(generation, digest))
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
    writes = [f for f in plan.files if f.action in ("create", "update")]
    need = sum(len(a.content.encode()) for a in artifacts if a.path in {f.path for f in writes}) * 2 + DISK_MARGIN
    for space in facts.disk:
        if space.read_only and writes:
            problems.append(PreflightProblem(node.name, "disk", f"{space.path} is on a read-only file system; remount it read-write"))
        elif writes and space.free_bytes < need:
            problems.append(
                PreflightProblem(node.name, "disk", f"{space.path}: {space.free_bytes} bytes free, need at least {need}; free space first")
            )
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
