"""The deploy engine's guarantees on three real SSH hosts: faults at every stage on one host, preflight that writes
nothing anywhere, locks, P/D generation rollback, drain through the router, apply through a jump host."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy.connectors import CommandResult, ConnectorError
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions
from bpdkv.deploy.fleet import apply_plan, load_fleet, lock_owner, plan_fleet
from bpdkv.deploy.runner import ApplyOptions, HostStatus
from bpdkv.topology.model import Node
from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts


def version_of(address: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{address}:{port}/version", timeout=5) as resp:
        return resp.read().decode()


@dataclass
class FaultyConnector:
    """A real SSH connector that raises once, at the first command or upload containing `needle`."""

    inner: SshConnector
    needle: str | None
    error: Exception
    before: Callable[[], None] | None = None  # instead of raising: do this (e.g. kill the host), then go on

    @property
    def host(self) -> str:
        return self.inner.host

    def _check(self, text: str) -> None:
        if self.needle and self.needle in text:
            self.needle = None
            if self.before is not None:
                self.before()
                return
            raise self.error

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        self._check(command)
        return self.inner.run(command, timeout)

    def put(self, data: bytes, path: str) -> None:
        self._check(path)
        self.inner.put(data, path)

    def get(self, path: str) -> bytes:
        return self.inner.get(path)

    def close(self) -> None:
        self.inner.close()


STAGES = {
    "upload": ".env.bpdkv-new",
    "rename": "mv -f",
    "daemon-reload": "daemon-reload",
    "start": "systemctl restart",
    "gate": "urllib.request",
    "manifest": "manifest.json.bpdkv-new",
}


# CI runs each stage once, kinds alternating (~37 s a case on 2 cores); BPDKV_FULL_FAULT_MATRIX=1 runs all 12 cases.
# The recording-connector twin (tests/unit/test_deploy_runner.py) runs all 12 in every run.
MATRIX = [
    (stage, kind)
    for i, stage in enumerate(STAGES)
    for kind in ("connector", "bug")
    if os.environ.get("BPDKV_FULL_FAULT_MATRIX") or kind == ("connector", "bug")[i % 2]
]


@pytest.mark.parametrize(("stage", "kind"), MATRIX)
def test_fault_matrix_one_host_keeps_serving_and_rerun_converges(hosts, tmp_path: Path, stage: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    doc = topology_doc(hosts)
    doc["vllm"]["start_timeout"] = 21  # every unit file changes too: daemon-reload is a stage on every host
    for node in doc["nodes"]:
        node["instances"][0]["env"] = {"FAKE_VERSION": "v2"}
    write_topology(topo, doc)

    error: Exception = ConnectorError("host2", f"injected at {stage}") if kind == "connector" else KeyError(f"injected at {stage}")

    def connect(node: Node) -> Any:
        inner = SshConnector(node, SshOptions())
        return FaultyConnector(inner, STAGES[stage], error) if node.name == "host2" else inner

    fleet = load_fleet(str(topo))
    try:
        plan = plan_fleet(fleet, False, 3, connect)
        report = apply_plan(fleet, plan, ApplyOptions(parallel=3, owner=lock_owner()))
    finally:
        fleet.close()
    outcome = report.outcomes["host2"]
    assert report.exit_code == 1 and outcome.status in (HostStatus.FAILED, HostStatus.ROLLED_BACK), report.to_json()
    assert f"injected at {stage}" in outcome.message
    assert version_of("10.213.0.12", 8200) == "v1"  # host2 serves its previous generation
    leftovers = subprocess.run(["find", str(hosts.hosts[1].fs), "-name", "*.bpdkv-new"], capture_output=True, text=True).stdout
    assert leftovers == ""  # temp files never stay
    assert report.outcomes["host1"].status is HostStatus.APPLIED and version_of("10.213.0.11", 8100) == "v2"

    assert bpdkv("plan", str(topo)).returncode == 2  # host2 still has work to do: plan and status agree
    assert bpdkv("status", str(topo)).returncode == 1
    rerun = bpdkv("apply", str(topo), "-y")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert version_of("10.213.0.12", 8200) == "v2"
    assert bpdkv("plan", str(topo)).returncode == 0
    assert bpdkv("status", str(topo)).returncode == 0


def test_read_only_target_and_changed_host_key_write_nothing_anywhere(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    hosts.exec(hosts.hosts[1], "mount -o remount,bind,ro /etc/bpdkv")
    try:
        refused = bpdkv("apply", str(topo), "-y")
    finally:
        hosts.exec(hosts.hosts[1], "mount -o remount,bind,rw /etc/bpdkv")
    assert refused.returncode == 1
    assert "host2: disk: /etc/bpdkv is on a read-only file system" in refused.stderr, refused.stderr
    for host in hosts.hosts:
        assert list((host.fs / "etc/bpdkv").iterdir()) == [] and not list((host.fs / "etc/systemd/system").glob("bpdkv-*"))

    # host3's key in known_hosts replaced by another key: refused, and nothing written on host1/host2 either
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    lines = hosts.known_hosts.read_text().splitlines()
    fake = Path(str(other) + ".pub").read_text().split()[:2]
    known.write_text("\n".join(line if not line.startswith("10.213.0.13 ") else f"10.213.0.13 {' '.join(fake)}" for line in lines) + "\n")
    doc = topology_doc(hosts)
    doc["ssh"]["known_hosts"] = str(known)
    write_topology(topo, doc)
    changed = bpdkv("apply", str(topo), "-y")
    assert changed.returncode == 1 and "host3: reachable:" in changed.stderr, changed.stderr
    for host in hosts.hosts:
        assert list((host.fs / "etc/bpdkv").iterdir()) == []


def test_sshd_killed_before_commit_is_dirty_then_repaired(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    doc = topology_doc(hosts)
    doc["vllm"]["env"] = {"FAKE_VERSION": "v2"}
    write_topology(topo, doc)
    victim = hosts.hosts[1]

    def connect(node: Node) -> Any:
        inner = SshConnector(node, SshOptions(command_timeout=20))
        return FaultyConnector(inner, "mv -f", RuntimeError("unused"), lambda: hosts.kill_host(victim)) if node.name == "host2" else inner

    fleet = load_fleet(str(topo))
    try:
        report = apply_plan(fleet, plan_fleet(fleet, False, 3, connect), ApplyOptions(parallel=3, owner=lock_owner()))
    finally:
        fleet.close()
        hosts.restart_host(victim)
    assert report.exit_code == 1 and report.outcomes["host2"].status in (HostStatus.FAILED, HostStatus.DIRTY), report.to_json()
    assert report.outcomes["host2"].status is not HostStatus.APPLIED
    # the next plan shows the unfinished host, and the lock the dead run could not release, naming its owner
    replan = bpdkv("plan", str(topo))
    assert replan.returncode == 1 and "host2: lock: another apply holds the lock" in replan.stderr, replan.stdout + replan.stderr
    assert "~ /etc/bpdkv/decode-0.env" in replan.stdout
    rerun = bpdkv("apply", str(topo), "-y", "--force-unlock")  # the dead run could not release host2's lock
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert bpdkv("plan", str(topo)).returncode == 0 and bpdkv("status", str(topo)).returncode == 0


def test_tiny_full_tmpfs_refused_before_any_write(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    hosts.exec(hosts.hosts[0], "mkdir -p /opt/bpdkv/bin && mount -t tmpfs -o size=16k tmpfs /opt/bpdkv/bin")
    try:
        refused = bpdkv("apply", str(topo), "-y")
    finally:
        hosts.exec(hosts.hosts[0], "umount /opt/bpdkv/bin")
    assert refused.returncode == 1 and "host1: disk: /opt/bpdkv/bin: " in refused.stderr and "bytes free" in refused.stderr
    for host in hosts.hosts:
        assert list((host.fs / "etc/bpdkv").iterdir()) == []


def test_second_apply_refused_naming_the_lock_owner(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    lock = {"owner": "alice@laptop pid 4242", "pid": "4242", "started": "2026-11-30T15:00:00Z", "topology": "hosts-test"}
    (hosts.hosts[2].fs / "var/lib/bpdkv/apply.lock").write_text(json.dumps(lock) + "\n")
    refused = bpdkv("apply", str(topo), "-y")
    assert refused.returncode == 1 and "host3: lock: another apply holds the lock: alice@laptop pid 4242" in refused.stderr
    assert list((hosts.hosts[0].fs / "etc/bpdkv").iterdir()) == []
    forced = bpdkv("apply", str(topo), "-y", "--force-unlock")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert not (hosts.hosts[2].fs / "var/lib/bpdkv/apply.lock").exists()  # released after the run


def test_pd_generation_rolls_back_together_and_drains_through_router(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    # a compatibility break (another vLLM pin) whose D fails its gate: P and D both go back to the old generation
    doc = topology_doc(hosts)
    doc["vllm"]["version"] = "0.99.0"
    doc["vllm"]["env"] = {"FAKE_VERSION": "v2"}
    doc["nodes"][1]["instances"][0]["env"] = {"FAKE_HEALTH": "fail"}
    write_topology(topo, doc)
    planned = json.loads(bpdkv("plan", str(topo), "--output", "json").stdout)
    assert planned["compat_break"] and planned["group"] == ["host1", "host2"]
    result = bpdkv("apply", str(topo), "-y", "--start-timeout", "3")
    assert result.returncode == 1
    assert "host2: rolled back: host2: bpdkv-decode-0.service: health gate failed" in result.stderr, result.stderr
    assert "host1: rolled back: generation rolled back because host2" in result.stderr
    assert version_of("10.213.0.11", 8100) == "v1" and version_of("10.213.0.12", 8200) == "v1"
    admin_log = (hosts.hosts[2].fs / "var/log/fake-router-admin.log").read_text().split("\n")
    assert "drain prefill-0" in admin_log and "undrain prefill-0" in admin_log and "drain decode-0" in admin_log
    assert bpdkv("plan", str(topo)).returncode == 2


def test_apply_through_a_jump_host(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    doc = topology_doc(hosts)
    for node in doc["nodes"][:2]:
        node["ssh"] = {"jump_host": "root@10.213.0.13"}
    topo = write_topology(tmp_path / "t.yaml", doc)
    # host1 and host2 cannot answer the CLI machine (10.213.0.1) at all: only through host3, gates included
    for host in hosts.hosts[:2]:
        hosts.exec(host, "ip route add blackhole 10.213.0.1/32")
    try:
        applied = bpdkv("apply", str(topo), "-y")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert bpdkv("plan", str(topo)).returncode == 0
        status = bpdkv("status", str(topo), "--output", "json")
        assert status.returncode == 0, status.stdout
        direct = write_topology(tmp_path / "direct.yaml", topology_doc(hosts))
        assert "host1: reachable: unreachable" in bpdkv("plan", str(direct)).stderr  # the route block is real
    finally:
        for host in hosts.hosts[:2]:
            hosts.exec(host, "ip route del blackhole 10.213.0.1/32")
