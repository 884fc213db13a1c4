"""The runner without hosts: a recording connector proves a saved plan runs exactly its operations, saved plans are
refused when the CLI build or the facts differ, and a bug (not a transport error) fails the host, never "applied"."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from bpdkv.deploy import operations as ops
from bpdkv.deploy.connectors import CommandResult, ConnectorError
from bpdkv.deploy.facts import MARKER
from bpdkv.deploy.fleet import StalePlan, apply_plan, check_saved_plan, load_fleet, load_saved_plan, plan_fleet, save_plan
from bpdkv.deploy.planner import Plan
from bpdkv.deploy.runner import ApplyOptions, HostStatus
from bpdkv.topology.model import Node

EMPTY_STATE = {
    "files": {},
    "units": {},
    "manifest": None,
    "gpus": None,
    "efa_devices": 0,
    "versions": {},
    "bpdkv_source": None,
    "wheelhouse": {},
    "lock": None,
    "dirty": None,
}


@dataclass
class RecordingConnector:
    """Answers the facts batch with a canned deploy state, every other command with exit 0, and records everything."""

    host: str
    state: dict[str, Any]
    calls: list[tuple[str, str]] = field(default_factory=list)
    fail_on: str | None = None  # a substring: the first command (or put path) with it raises `error`, once
    error: Exception | None = None

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        self._maybe_fail(command)
        if command.startswith(f"echo {MARKER}0"):
            return CommandResult(0, f"{MARKER}0\n{json.dumps(self.state)}\n", "")
        self.calls.append(("run", command))
        if "urllib.request" in command:  # a probe on the node
            return CommandResult(0, json.dumps({"failure": None, "body": ""}) + "\n", "")
        return CommandResult(0, "", "")

    def put(self, data: bytes, path: str) -> None:
        self._maybe_fail(path)
        self.calls.append(("put", path))

    def get(self, path: str) -> bytes:
        raise ConnectorError(self.host, "not used")

    def close(self) -> None:
        pass

    def _maybe_fail(self, text: str) -> None:
        if self.fail_on and self.fail_on in text and self.error is not None:
            self.fail_on = None
            raise self.error


def _topology(tmp_path: Path) -> Path:
    doc = {
        "apiVersion": "bpdkv/v1",
        "name": "unit-runner",
        "profile": "tiny-cpu",
        "ssh": {"user": "root", "known_hosts": str(tmp_path / "known_hosts")},
        "vllm": {"start_timeout": 5},
        "bootstrap": {"enabled": False},
        "nodes": [
            {"name": "host1", "host": "10.0.0.1", "hardware": "cpu", "instances": [{"role": "prefill", "port": 8100}]},
            {"name": "host2", "host": "10.0.0.2", "hardware": "cpu", "instances": [{"role": "decode", "port": 8200}]},
            {"name": "host3", "host": "10.0.0.3", "hardware": "cpu", "instances": [{"role": "router", "port": 8000}]},
        ],
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _probe_request(command: str) -> dict[str, Any] | None:
    """The request of connectors.probe's command (python3 on the node), or None for any other command."""
    words = shlex.split(command)
    if len(words) == 4 and words[:2] == ["python3", "-c"] and "urllib.request" in words[2]:
        request: dict[str, Any] = json.loads(words[3])
        return request
    return None


def assert_only_planned(plan: Plan, conns: dict[str, RecordingConnector], owner: str) -> int:
    """Every shell command the runner sent to a host is one its plan holds (ops.shell_commands), and every HTTP request
    from a node asks a URL an operation of the plan names (gates; the router's admin API for drains). Returns how many
    commands were checked."""
    hosts = {hp.host: hp for hp in plan.hosts}
    checked = 0
    for host, conn in conns.items():
        hp = hosts[host]
        planned = {c for op in hp.operations for c in ops.shell_commands(op, owner)}
        urls = {(op.base, tuple(op.paths)) for op in hp.operations if isinstance(op, ops.HealthGate)}
        for drain in (op for h in plan.hosts for op in h.operations if isinstance(op, ops.Drain | ops.Undrain)):
            if drain.router_host == host:
                for path in (f"/admin/upstreams/{drain.instance}/drain", f"/admin/upstreams/{drain.instance}/undrain", "/admin/upstreams"):
                    urls.add((drain.admin_base, (path,)))
        probes = {c for h in plan.hosts for op in h.operations if isinstance(op, ops.ProbePull) and op.p_host == host for c in [op.command]}
        probes |= {op.processes for h in plan.hosts for op in h.operations if isinstance(op, ops.ProbePull) and op.d_host == host}
        for kind, command in conn.calls:
            if kind != "run":
                continue
            checked += 1
            request = _probe_request(command)
            if request is not None:
                assert (request["base"], tuple(request["paths"])) in urls, f"{host}: HTTP not in the plan: {request}"
            else:
                assert command in planned | probes, f"{host}: the runner sent a command that is not in the plan:\n{command}"
    return checked


class Lab:
    def __init__(self) -> None:
        self.conns: dict[str, RecordingConnector] = {}
        self.state: dict[str, dict[str, Any]] = {}

    def connect(self, node: Node) -> RecordingConnector:
        conn = RecordingConnector(node.name, self.state.get(node.name, EMPTY_STATE))
        self.conns[node.name] = conn
        return conn


def test_saved_plan_runs_exactly_its_operations(tmp_path: Path) -> None:
    topo = _topology(tmp_path)
    lab = Lab()
    fleet = load_fleet(str(topo))
    plan = plan_fleet(fleet, False, 2, lab.connect)
    saved_file = tmp_path / "plan.json"
    save_plan(plan, fleet, saved_file)

    # Edit the saved operations: drop host1's env upload. What runs must be the file, not a fresh plan.
    data = json.loads(saved_file.read_text())
    host1 = data["hosts"][0]
    dropped = next(op for op in host1["operations"] if op["op"] == "upload" and op["path"].endswith(".env"))
    host1["operations"].remove(dropped)
    saved_file.write_text(json.dumps(data))

    saved = load_saved_plan(saved_file)
    fleet = load_fleet(saved.topology_file)
    fresh = plan_fleet(fleet, False, 2, lab.connect)
    check_saved_plan(saved, fresh, fleet)
    report = apply_plan(fleet, saved.plan, ApplyOptions(parallel=2, owner="unit pid 1"))
    assert report.exit_code == 0, report.failed_lines()

    for hp in saved.plan.hosts:
        calls = lab.conns[hp.host].calls
        uploads = [op.path + ".bpdkv-new" for op in hp.operations if isinstance(op, ops.UploadFile)]
        puts = [path for kind, path in calls if kind == "put"]
        assert puts == uploads + ["/etc/bpdkv/manifest.json.bpdkv-new"]
        starts = [c for kind, c in calls if kind == "run" and "systemctl start" in c]
        assert starts == [op.command() for op in hp.operations if isinstance(op, ops.StartUnit)]
        probes = [c for kind, c in calls if kind == "run" and "urllib.request" in c]
        assert len(probes) == sum(isinstance(op, ops.HealthGate) for op in hp.operations)
    assert dropped["path"] + ".bpdkv-new" not in [p for k, p in lab.conns["host1"].calls if k == "put"]
    assert assert_only_planned(saved.plan, lab.conns, "unit pid 1") > 20


def test_saved_plan_refused_for_another_build_and_changed_facts(tmp_path: Path) -> None:
    topo = _topology(tmp_path)
    lab = Lab()
    fleet = load_fleet(str(topo))
    saved_file = tmp_path / "plan.json"
    save_plan(plan_fleet(fleet, False, 2, lab.connect), fleet, saved_file)
    data = json.loads(saved_file.read_text())
    data["cli_build"] = "0123456789abcdef"
    saved_file.write_text(json.dumps(data))
    lab.state["host2"] = dict(EMPTY_STATE, units={"bpdkv-decode-0.service": "active"})
    saved = load_saved_plan(saved_file)
    fresh = plan_fleet(fleet, False, 2, lab.connect)
    with pytest.raises(StalePlan) as refused:
        check_saved_plan(saved, fresh, fleet)
    message = str(refused.value)
    assert "another bpdkv build (0123456789abcdef" in message
    lines = refused.value.lines()
    assert (
        "saved plan refused: host2: unit bpdkv-decode-0.service: unknown → active (since the plan was saved: drift or another apply)"
        in lines
    )
    assert "host1" not in message and "host3" not in message


@pytest.mark.parametrize(
    ("stage", "needle"),
    [
        ("upload", ".bpdkv-new"),
        ("rename", "mv -f"),
        ("daemon-reload", "daemon-reload"),
        ("start", "systemctl start"),
        ("gate", "urllib.request"),
        ("manifest", "manifest.json"),
    ],
)
@pytest.mark.parametrize("kind", ["connector", "bug"])
def test_fault_on_one_host_is_reported_never_applied(tmp_path: Path, stage: str, needle: str, kind: str) -> None:
    topo = _topology(tmp_path)
    lab = Lab()
    fleet = load_fleet(str(topo))
    plan = plan_fleet(fleet, False, 2, lab.connect)
    conn = lab.conns["host2"]
    conn.fail_on = needle
    conn.error = ConnectorError("host2", f"injected at {stage}") if kind == "connector" else KeyError(f"injected at {stage}")
    report = apply_plan(fleet, plan, ApplyOptions(parallel=2, owner="unit pid 1"))
    outcome = report.outcomes["host2"]
    assert report.exit_code == 1
    assert outcome.status is not HostStatus.APPLIED and not outcome.status.ok
    assert f"injected at {stage}" in outcome.message
    if kind == "bug":
        assert "internal error (KeyError" in outcome.message and "KeyError" in outcome.traceback
    # a failure after the files were committed restores them (the restore script ran) or records the host dirty
    ran = [c for k, c in conn.calls if k == "run"]
    if stage in ("daemon-reload", "start", "gate", "manifest"):
        assert outcome.status in (HostStatus.ROLLED_BACK, HostStatus.DIRTY)
        assert any(c.startswith("set -u\nB=") and c.rstrip().endswith("restore") for c in ran) or outcome.status is HostStatus.DIRTY
    # the lock is always released and temp files removed
    assert any("apply.lock" in c and "rm -f" in c for c in ran)
    # whatever failed, every command sent (rollback, restore, log reads included) is one the plan holds
    assert_only_planned(plan, lab.conns, "unit pid 1")


def test_commit_script_restores_every_file_when_a_rename_fails(tmp_path: Path) -> None:
    """The real shell script on a real folder: the first file is renamed, the second rename fails → all put back."""
    import hashlib
    import subprocess

    from bpdkv.deploy.operations import TMP_SUFFIX, commit_script

    old = tmp_path / "etc" / "a.env"
    old.parent.mkdir()
    old.write_text("A=old\n")
    (tmp_path / "etc" / ("a.env" + TMP_SUFFIX)).write_text("A=new\n")
    created = tmp_path / "etc" / "b.env"
    (tmp_path / "etc" / ("b.env" + TMP_SUFFIX)).write_text("B=new\n")
    broken = tmp_path / "missing-folder" / "c.env"  # never staged: its chmod/mv fails
    changes = [
        ops.UploadFile(str(old), 0o600, hashlib.sha256(b"A=new\n").hexdigest()),
        ops.UploadFile(str(created), 0o644, hashlib.sha256(b"B=new\n").hexdigest()),
        ops.UploadFile(str(broken), 0o644, "0" * 64),
    ]
    script = commit_script(str(tmp_path / "backup"), changes)
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert str(broken) in proc.stderr
    assert old.read_text() == "A=old\n" and not created.exists()
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["a.env"]  # no temp file stays

    # and when every rename works, the files are the new ones with their modes
    (tmp_path / "etc" / ("a.env" + TMP_SUFFIX)).write_text("A=new\n")
    (tmp_path / "etc" / ("b.env" + TMP_SUFFIX)).write_text("B=new\n")
    ok = subprocess.run(["sh", "-c", commit_script(str(tmp_path / "backup"), changes[:2])], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert old.read_text() == "A=new\n" and created.read_text() == "B=new\n" and (old.stat().st_mode & 0o777) == 0o600


def test_restore_after_a_commit_cut_off_mid_rename_leaves_unchanged_files_alone(tmp_path: Path) -> None:
    """A commit killed after its first rename: the restore puts that file back, never renames a file still equal to its
    backup (an immutable one would refuse), leaves no temp copies, and can run twice."""
    import hashlib
    import subprocess

    from bpdkv.deploy.operations import TMP_SUFFIX, commit_script, restore_script

    etc = tmp_path / "etc"
    etc.mkdir()
    first, second = etc / "a.env", etc / "b.service"
    first.write_text("A=old\n")
    second.write_text("B=old\n")
    for f, text in ((first, "A=new\n"), (second, "B=new\n")):
        (etc / (f.name + TMP_SUFFIX)).write_text(text)
    new = {first: b"A=new\n", second: b"B=new\n"}
    changes = [ops.UploadFile(str(f), 0o644, hashlib.sha256(new[f]).hexdigest()) for f in (first, second)]
    script = commit_script(str(tmp_path / "backup"), changes)
    lines = script.splitlines()
    first_mv = next(i for i, line in enumerate(lines) if "mv -f" in line and TMP_SUFFIX in line)
    cut = "\n".join([*lines[: first_mv + 1], "kill -KILL $$"])  # the shell dies right after the first rename
    subprocess.run(["sh", "-c", cut], capture_output=True, text=True, timeout=30)
    assert first.read_text() == "A=new\n" and second.read_text() == "B=old\n"
    untouched = second.stat().st_ino
    for _ in range(2):
        proc = subprocess.run(["sh", "-c", restore_script(str(tmp_path / "backup"))], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert first.read_text() == "A=old\n" and second.read_text() == "B=old\n"
        assert second.stat().st_ino == untouched  # equal to its backup: not replaced
        assert not list(etc.glob("*.bpdkv-old"))


def test_saved_plan_depends_on_file_groups_service_users_and_packages() -> None:
    from dataclasses import replace

    from bpdkv.deploy.facts import HostFacts
    from bpdkv.deploy.planner import facts_digest, facts_parts

    key = "/etc/bpdkv/prefill-0.env"
    base = HostFacts("h", True, None, None, {key: {"sha256": "a" * 64, "mode": 0o640, "group": "vllm"}}, {}, user_groups={"vllm": "vllm"})
    regrouped = replace(base, files={key: {"sha256": "a" * 64, "mode": 0o640, "group": "root"}})
    user_moved = replace(base, user_groups={"vllm": "staff"})
    package_gone = replace(base, debian={"redis-server": False})
    for changed, what in ((regrouped, "files"), (user_moved, "service users"), (package_gone, "system packages")):
        assert facts_digest(changed) != facts_digest(base)
        assert [k for k, v in facts_parts(changed).items() if facts_parts(base)[k] != v] == [what]
    assert facts_digest(replace(base)) == facts_digest(base)


def test_a_refused_saved_plan_names_each_difference() -> None:
    """Host, file or unit, and what differs: content digest, mode, owner, group, unit state, package version."""
    from bpdkv.deploy.facts import HostFacts
    from bpdkv.deploy.planner import fact_differences, facts_detail

    def facts(sha: str, mode: int, owner: str, state: str, vllm: str, redis: bool) -> HostFacts:
        info = {"sha256": sha * 64, "mode": mode, "owner": owner, "group": "root", "content": None}
        return HostFacts(
            "host1",
            True,
            files={"/etc/bpdkv/a.env": info},
            units={"u.service": state},
            versions={"vllm": vllm},
            debian={"redis-server": redis},
        )

    before = facts_detail(facts("a", 0o644, "root", "active", "0.1", True))
    assert fact_differences("host1", before, facts("a", 0o644, "root", "active", "0.1", True)) == []
    assert fact_differences("host1", before, facts("b", 0o600, "nobody", "failed", "0.2", False)) == [
        f"host1: /etc/bpdkv/a.env: content sha256 {'a' * 12} → {'b' * 12}",
        "host1: /etc/bpdkv/a.env: mode 644 → 600",
        "host1: /etc/bpdkv/a.env: owner root → nobody",
        "host1: unit u.service: active → failed",
        "host1: package vllm: 0.1 → 0.2",
        "host1: Debian package redis-server: installed → missing",
    ]


class RouterNode(RecordingConnector):
    """The router's node: its admin API lists every instance as drained (a drain finishes at once)."""

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        request = _probe_request(command)
        if request is not None and "/admin/upstreams" in request["paths"][0]:
            self.calls.append(("run", command))
            listing = {"upstreams": [{"name": n, "state": "drained"} for n in ("prefill-0", "decode-0")]}
            return CommandResult(0, json.dumps({"failure": None, "body": json.dumps(listing)}) + "\n", "")
        return super().run(command, timeout)


def test_a_rolling_restart_sends_only_planned_commands_and_urls(tmp_path: Path) -> None:
    """A running fleet whose P and D env files changed: drains through the router's admin API (its URLs in the plan),
    restarts, gates; then the same with D's gate failing, so the rollback's restore, unit restarts and undrains run.
    Every command and URL is the plan's."""
    topo = _topology(tmp_path)
    lab = Lab()
    for host, inst in (("host1", "prefill-0"), ("host2", "decode-0"), ("host3", "router-0")):
        files = {a.path: {"sha256": "f" * 64, "mode": a.mode} for a in load_fleet(str(topo)).artifacts if a.host == host}
        lab.state[host] = dict(EMPTY_STATE, units={f"bpdkv-{inst}.service": "active"}, files=files)

    def connect(node: Node) -> RecordingConnector:
        cls = RouterNode if node.name == "host3" else RecordingConnector
        conn = cls(node.name, lab.state.get(node.name, EMPTY_STATE))
        lab.conns[node.name] = conn
        return conn

    for failing in (None, "decode"):
        fleet = load_fleet(str(topo))
        plan = plan_fleet(fleet, False, 2, connect)
        drains = [op for hp in plan.hosts for op in hp.operations if isinstance(op, ops.Drain)]
        assert [d.instance for d in drains] == ["prefill-0", "decode-0"] and all(d.admin_base == "http://127.0.0.1:8000" for d in drains)
        if failing:
            lab.conns["host2"].fail_on, lab.conns["host2"].error = "systemctl restart", ConnectorError("host2", "injected")
        report = apply_plan(fleet, plan, ApplyOptions(parallel=2, owner="unit pid 1"))
        admin = [c for _, c in lab.conns["host3"].calls if "/admin/upstreams/" in c]
        assert any("/admin/upstreams/prefill-0/drain" in c for c in admin)
        if failing:
            assert report.outcomes["host2"].status is HostStatus.ROLLED_BACK, report.failed_lines()
            ran = [c for k, c in lab.conns["host2"].calls if k == "run"]
            assert any(c.rstrip().endswith("restore") for c in ran)
            assert any("/admin/upstreams/decode-0/undrain" in c for c in admin)
        else:
            assert report.exit_code == 0, report.failed_lines()
        assert assert_only_planned(plan, lab.conns, "unit pid 1") > 10


def test_the_plan_check_catches_a_command_the_plan_does_not_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: a runner that composes one command of its own is caught."""
    from bpdkv.deploy.runner import Runner

    topo = _topology(tmp_path)
    lab = Lab()
    fleet = load_fleet(str(topo))
    plan = plan_fleet(fleet, False, 2, lab.connect)
    original = Runner.remove_temps

    def own_shell(self: Runner, hp: Any) -> None:
        self.conns[hp.host].run("rm -rf /var/lib/bpdkv/backup")
        original(self, hp)

    monkeypatch.setattr(Runner, "remove_temps", own_shell)
    assert apply_plan(fleet, plan, ApplyOptions(parallel=2, owner="unit pid 1")).exit_code == 0
    with pytest.raises(AssertionError, match="not in the plan"):
        assert_only_planned(plan, lab.conns, "unit pid 1")
