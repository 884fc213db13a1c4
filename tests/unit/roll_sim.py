"""An in-memory fleet for the roll's fault tests: hosts with files, manifests, locks, units and engines, and a router
that reads its config file and answers its admin API — driven by the real planner (make_plan) and the real runner
(Runner.run) through connectors that interpret exactly the commands the plan's operations hold.

A SIGKILL of `bpdkv apply` is `Sim.kill_after = N`: the N-th command or upload completes, every later one raises
`Killed` (a BaseException: no `except Exception` of the runner catches it, as no code runs after a SIGKILL), so nothing
after the kill point reaches a host — no rollback, no unlock, no clean-up. The router and the engines keep running.

What an engine runs after a (re)start follows its files on disk: the new release where every file of its instance is
the new topology's render, the old one otherwise (its unit, env and launch script name the venv and flags).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks import upgrade
from bpdkv import __version__
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import source_digest
from bpdkv.deploy.connectors import CommandResult, ConnectorError
from bpdkv.deploy.facts import MANIFEST_PATH, HostFacts
from bpdkv.deploy.operations import TMP_SUFFIX
from bpdkv.deploy.planner import Plan, generation_id, make_plan, manifest_for
from bpdkv.deploy.runner import ApplyOptions, PackageSource, Report, Runner
from bpdkv.render import Artifact, render_topology
from tests.unit.test_cohort_plan import load

METRICS = "vllm:nixl_bytes_transferred_sum {n}\nvllm:nixl_bytes_transferred_count {c}\n"


_LOADED: dict[str, tuple[Any, Any, list[Artifact], list[Artifact]]] = {}


class Killed(BaseException):
    """apply was SIGKILLed: nothing more reaches any host."""


class FakeClock:
    """The runner's clock: sleeping advances it at once (a gate that cannot pass fails without waiting for real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class SimHost:
    name: str
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # path → (content, mode)
    manifest: dict[str, Any] | None = None
    units: dict[str, str] = field(default_factory=dict)  # unit → active | inactive | failed
    instances: dict[str, str] = field(default_factory=dict)  # unit → instance
    engines: dict[str, str | None] = field(default_factory=dict)  # instance → release it runs (None: down)
    staged: dict[str, str] = field(default_factory=dict)
    backup: dict[str, tuple[str, int] | None] = field(default_factory=dict)  # what the last commit replaced
    lock: dict[str, Any] | None = None
    installed: set[str] = field(default_factory=set)  # releases whose venv the bootstrap installed


@dataclass
class Sim:
    old_topology: Any
    new_topology: Any
    hosts: dict[str, SimHost] = field(default_factory=dict)
    drained: set[str] = field(default_factory=set)  # the router's drains (kept across applies: the router runs on)
    router_path: str = ""
    calls: int = 0
    kill_after: int | None = None
    events: list[str] = field(default_factory=list)
    capacity: list[tuple[int, int, bool]] = field(default_factory=list)  # after each call: P, D serving, a complete generation
    plan: Plan | None = None  # the plan being applied (its operations are the commands understood)
    new_artifacts: list[Artifact] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)  # engines killed by a fault (not by the roll); a restart revives them
    fail_put: set[str] = field(default_factory=set)  # "host:path" uploads that fail once (a transport error)

    # ---- set-up --------------------------------------------------------------------------------------------------
    @staticmethod
    def deployed(tmp: Path, old_doc: dict[str, Any] | None = None, new_doc: dict[str, Any] | None = None) -> Sim:
        key = json.dumps([old_doc, new_doc], sort_keys=True)
        if key not in _LOADED:  # topologies and renders are immutable: loaded once per pair for every simulated apply
            tmp.mkdir(parents=True, exist_ok=True)
            old_t = load(tmp, "old", old_doc or upgrade.topology(upgrade.OLD))
            new_t = load(tmp, "new", new_doc or upgrade.topology(upgrade.NEW))
            _LOADED[key] = (old_t, new_t, render_topology(old_t), render_topology(new_t))
        old, new, old_arts, new_arts = _LOADED[key]
        sim = Sim(old, new)
        sim.new_artifacts = list(new_arts)
        for node in old.nodes:
            arts = [a for a in old_arts if a.host == node.name]
            host = SimHost(node.name)
            host.files = {a.path: (a.content, a.mode) for a in arts}
            host.manifest = manifest_for(old, node.name, arts, generation_id(arts))
            host.instances = {i.unit: i.name for i in node.instances}
            spare = bool(getattr(node, "spare", False))
            host.units = {i.unit: "inactive" if spare and i.role != "router" else "active" for i in node.instances}
            host.engines = {i.name: (None if spare else upgrade.OLD) for i in node.instances if i.role != "router"}
            host.installed = {upgrade.OLD}
            sim.hosts[node.name] = host
            for a in arts:
                if a.path.endswith(".router.yaml"):
                    sim.router_path = a.path
        return sim

    # ---- what the nodes look like ----------------------------------------------------------------------------------
    def facts(self, force_unlock: bool = True) -> dict[str, HostFacts]:
        topo = self.new_topology
        out: dict[str, HostFacts] = {}
        for node in topo.nodes:
            host = self.hosts[node.name]
            if force_unlock:
                host.lock = None
            paths = {a.path for a in self.new_artifacts if a.host == node.name} | set((host.manifest or {}).get("files", {}))
            files: dict[str, dict[str, Any] | None] = {}
            for path in sorted(paths):
                if path in host.files:
                    content, mode = host.files[path]
                    files[path] = {
                        "sha256": hashlib.sha256(content.encode()).hexdigest(),
                        "mode": mode,
                        "content": base64.b64encode(content.encode()).decode(),
                        "size": len(content.encode()),
                    }
                else:
                    files[path] = None
            units = sorted(set(host.units) | set((host.manifest or {}).get("units", [])))
            installed = topo.vllm.version in host.installed
            versions = {"bpdkv": __version__, topo.vllm.package: topo.vllm.version, "nixl": "1.5.1"} if installed else {}
            engines = {u: host.engines.get(i) for u, i in host.instances.items() if i in host.engines}
            out[node.name] = HostFacts(
                node.name,
                True,
                manifest=json.loads(json.dumps(host.manifest)) if host.manifest is not None else None,
                files=files,
                units={u: host.units.get(u, "inactive") for u in units},
                versions=versions,
                bpdkv_source=source_digest() if installed else None,
                lock=host.lock,
                engines=engines,
            )
        return out

    def router_config(self) -> dict[str, Any]:
        return _parsed(self.hosts["host3"].files.get(self.router_path, ("", 0))[0])

    def listing(self) -> list[dict[str, Any]]:
        config = self.router_config()
        release = {g["id"]: g["vllm"] for g in config.get("generations", [])}
        out = []
        for role in ("prefill", "decode"):
            for member in config.get(role, []):
                name, gen = member["name"], member.get("generation", "")
                runs = self.engine(name)
                if runs is None:
                    state = "unhealthy"
                elif gen in release and runs != release[gen]:
                    state = "mismatched"
                elif name in self.drained:
                    state = "drained"
                else:
                    state = "serving"
                out.append({"name": name, "role": role, "state": state, "generation": gen, "in_flight": 0})
        return out

    def serving(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {g["id"]: {"prefill": 0, "decode": 0} for g in self.router_config().get("generations", [])}
        for u in self.listing():
            if u["state"] == "serving":
                out.setdefault(u["generation"], {"prefill": 0, "decode": 0})[u["role"]] += 1
        return out

    def engine(self, instance: str) -> str | None:
        for host in self.hosts.values():
            if instance in host.engines:
                return host.engines[instance]
        return None

    def release_on_disk(self, host: SimHost, instance: str) -> str:
        mine = [a for a in self.new_artifacts if a.host == host.name and a.instance == instance]
        new = all(host.files.get(a.path, ("", 0))[0] == a.content for a in mine)
        return self.new_topology.vllm.version if new else self.old_topology.vllm.version

    # ---- one apply -------------------------------------------------------------------------------------------------
    def apply(self, max_unavailable: int = 1, clock: FakeClock | None = None) -> tuple[Plan, Report]:
        """plan + apply --force-unlock of the new topology, as the CLI does it (facts, make_plan, Runner.run)."""
        facts = self.facts(force_unlock=True)
        plan = make_plan(self.new_topology, self.new_artifacts, facts, owner="sim", max_unavailable=max_unavailable)
        self.plan = plan
        conns = {name: SimConn(self, host) for name, host in self.hosts.items()}
        packages = PackageSource({}, "bpdkv-0.1.0-py3-none-any.whl", offline=False)
        runner = Runner(
            self.new_topology,
            self.new_artifacts,
            plan,
            conns,  # type: ignore[arg-type]
            ApplyOptions(owner="sim", max_unavailable=max_unavailable, drain_timeout=30.0),
            packages=packages,
            facts=facts,
        )
        return plan, runner.run()

    def plan_now(self) -> Plan:
        """`bpdkv plan`: no lock is its own."""
        return make_plan(self.new_topology, self.new_artifacts, self.facts(force_unlock=False))

    def tick(self) -> None:
        self.calls += 1
        if self.kill_after is not None and self.calls > self.kill_after:
            raise Killed()

    def after_call(self) -> None:
        serving = self.serving()
        p = sum(c["prefill"] for c in serving.values())
        d = sum(c["decode"] for c in serving.values())
        self.capacity.append((p, d, any(c["prefill"] and c["decode"] for c in serving.values())))


@functools.lru_cache(maxsize=64)
def _parsed(content: str) -> dict[str, Any]:
    """The router's config as it reads it (parsed once per content: every call of every simulated apply asks)."""
    data = yaml.load(content, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return data if isinstance(data, dict) else {}


INSTALL_REPORT_MODULES = ["vllm", "nixl", "bpdkv.vllm_plugin", "bpdkv.vllm_plugin.connector", "bpdkv.router.app"]


class SimConn:
    def __init__(self, sim: Sim, host: SimHost) -> None:
        self.sim, self.host = sim, host

    def put(self, data: bytes, path: str) -> None:
        self.sim.tick()
        if f"{self.host.name}:{path}" in self.sim.fail_put:
            self.sim.fail_put.discard(f"{self.host.name}:{path}")
            raise ConnectorError(self.host.name, f"upload of {path} failed: connection reset")
        self.host.staged[path] = data.decode()
        self.sim.after_call()

    def get(self, path: str) -> bytes:
        raise ConnectorError(self.host.name, "not used")

    def close(self) -> None:
        pass

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        self.sim.tick()
        try:
            return self._run(command)
        finally:
            self.sim.after_call()

    def _ops(self) -> list[Any]:
        plan = self.sim.plan
        assert plan is not None
        hp = next(h for h in plan.hosts if h.host == self.host.name)
        return list(hp.operations)

    def _run(self, command: str) -> CommandResult:
        sim, host = self.sim, self.host
        words = shlex.split(command) if command.startswith("python3 -c") else []
        if len(words) == 4 and "urllib.request" in words[2]:
            return self.http(json.loads(words[3]))
        if command.startswith("sh -c") and "pip install" in command:
            topo = sim.new_topology
            host.installed.add(topo.vllm.version)
            report = {
                "python": "3.11",
                "versions": {topo.vllm.package: topo.vllm.version, "nixl": "1.5.1", "bpdkv": __version__},
                "imports": {m: "ok" for m in INSTALL_REPORT_MODULES},
                "bpdkv_file": f"{topo.vllm.venv}/lib/python3.11/site-packages/bpdkv/__init__.py",
            }
            return CommandResult(0, json.dumps(report) + "\n", "")
        if "bpdkv.deploy.efa" in command:  # a probe turn from P's node: KV moves only between engines of one release
            plan = sim.plan
            assert plan is not None and plan.roll is not None
            probe = next(p for s in plan.roll.steps for p in s.probes if p.command == command)
            p_runs, d_runs = sim.engine(probe.prefill), sim.engine(probe.decode)
            if p_runs is None or d_runs is None or p_runs != d_runs:
                return CommandResult(0, json.dumps({"before": "", "after": "", "error": f"P {p_runs} D {d_runs}"}) + "\n", "")
            body = {"before": METRICS.format(n=0, c=0), "after": METRICS.format(n=65536, c=1), "error": None}
            return CommandResult(0, json.dumps(body) + "\n", "")
        plan = sim.plan
        assert plan is not None
        if plan.roll is not None:
            writes = [plan.roll.prepare] + [s.router for s in plan.roll.steps]
            for w in writes:
                if command == w.command() and w.host == host.name:
                    host.files[w.path] = (host.staged.pop(w.path + TMP_SUFFIX), w.mode)
                    sim.events.append(f"router config {w.digest}")
                    return CommandResult(0, "", "")
            for s in plan.roll.steps:
                for stop_host, stop in s.stops:
                    if stop_host == host.name and command == stop.command():
                        return self.stop(stop.unit)
        for op in self._ops():
            if isinstance(op, ops.Lock) and command == op.command("sim"):
                if host.lock is not None:
                    return CommandResult(3, json.dumps(host.lock) + "\n", "")
                host.lock = {"owner": "sim", "pid": "1", "started": "now", "topology": op.topology}
                return CommandResult(0, "", "")
            if isinstance(op, ops.Unlock) and command == op.command("sim"):
                host.lock = None
                return CommandResult(0, "", "")
            if isinstance(op, ops.Commit) and command == op.script:
                host.backup = {}
                for change in self._ops():
                    if isinstance(change, ops.UploadFile):
                        host.backup[change.path] = host.files.get(change.path)
                        host.files[change.path] = (host.staged.pop(change.path + TMP_SUFFIX), change.mode)
                    elif isinstance(change, ops.DeleteFile):
                        host.backup[change.path] = host.files.pop(change.path, None)
                sim.events.append(f"commit {host.name}")
                return CommandResult(0, "", "")
            if isinstance(op, ops.Commit) and command == op.restore:
                for path, was in host.backup.items():
                    if was is None:
                        host.files.pop(path, None)
                    else:
                        host.files[path] = was
                sim.events.append(f"restore {host.name}")
                return CommandResult(0, "", "")
            if isinstance(op, ops.StartUnit) and command == op.command():
                return self.start(op.unit, undo=False)
            if isinstance(op, ops.StartUnit) and command == op.undo_command():
                return self.stop(op.unit) if op.new else self.start(op.unit, undo=True)
            if isinstance(op, ops.StopUnit) and command == op.command():
                return self.stop(op.unit)
            if isinstance(op, ops.WriteManifest) and command == op.command():
                host.manifest = json.loads(host.staged.pop(MANIFEST_PATH + TMP_SUFFIX))
                sim.events.append(f"manifest {host.name}")
                return CommandResult(0, "", "")
            if isinstance(op, ops.RemoveStaged) and command == op.command():
                host.staged.clear()
                return CommandResult(0, "", "")
        return CommandResult(0, "", "")  # mkdir, daemon-reload, the bootstrap's record, the dirty marker's writer

    def start(self, unit: str, undo: bool) -> CommandResult:
        host, sim = self.host, self.sim
        host.units[unit] = "active"
        instance = host.instances.get(unit)
        if instance is not None and instance in host.engines:
            host.engines[instance] = sim.release_on_disk(host, instance)
            sim.dead.discard(instance)
            sim.events.append(f"{'undo ' if undo else ''}restart {instance} → {host.engines[instance]}")
        return CommandResult(0, "", "")

    def stop(self, unit: str) -> CommandResult:
        host = self.host
        host.units[unit] = "inactive"
        instance = host.instances.get(unit)
        if instance is not None and instance in host.engines:
            host.engines[instance] = None
            self.sim.events.append(f"stop {instance}")
        return CommandResult(0, "", "")

    def http(self, request: dict[str, Any]) -> CommandResult:
        sim = self.sim
        path = request["paths"][0]
        body, failure = "", None
        if path == "/admin/config":
            content = self.host.files.get(sim.router_path, ("", 0))[0]
            body = json.dumps({"digest": hashlib.sha256(content.encode()).hexdigest()[:16], "serving": sim.serving()})
        elif path.startswith("/admin/upstreams/"):
            name, action = path.split("/")[3:5]
            (sim.drained.add if action == "drain" else sim.drained.discard)(name)
            sim.events.append(f"{action} {name}")
            body = json.dumps({"name": name, "state": "drained" if action == "drain" else "serving"})
        elif path == "/admin/upstreams":
            body = json.dumps({"upstreams": sim.listing()})
        elif path in ("/health", "/v1/models"):
            port = int(request["base"].rsplit(":", 1)[1].split("/")[0])
            node = next(n for n in sim.new_topology.nodes if n.name == self.host.name)
            inst = next((i for i in node.instances if i.port == port), None)
            if inst is not None and inst.role != "router" and self.host.engines.get(inst.name) is None:
                failure = f"{path}: [Errno 111] Connection refused"
            else:
                body = "{}"
        return CommandResult(0, json.dumps({"failure": failure, "body": body}) + "\n", "")
