"""Issue 25 on three real SSH hosts: no file lost at any write of the commit (I/O errors, a killed session, a really
full disk), a failed daemon-reload fails the host, and a host that stops answering (sshd frozen, link down, a
half-open connection) is given up on within the stated bound while the others go on."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy.connectors import CommandResult, Connector
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions
from bpdkv.deploy.fleet import Fleet, apply_plan, load_fleet, lock_owner, plan_fleet
from bpdkv.deploy.planner import Plan
from bpdkv.deploy.runner import ApplyOptions, HostStatus, Report
from bpdkv.lab.hosts import TestHost, TestHosts
from bpdkv.topology.model import Node
from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts
FULL = bool(os.environ.get("BPDKV_FULL_FAULT_MATRIX"))
COMMIT_MARK = 'touch "$B/.complete"'  # in the last line of the commit script: how a test connector knows it


def version_of(address: str, port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}:{port}/version", timeout=5) as resp:
        return resp.read().decode()


def doc_version(hosts: TestHosts, version: str, unit_change: int = 20) -> dict[str, Any]:
    """Every host changes its env file and (start_timeout) its unit file: two files per host, daemon-reload on each."""
    doc = topology_doc(hosts)
    doc["vllm"]["start_timeout"] = unit_change
    doc["vllm"]["env"] = {"FAKE_VERSION": version}
    return doc


def managed_files(host: TestHost) -> dict[str, tuple[bytes, int]]:
    """Every file a deploy manages on the host, as (content, mode), keyed by its path on the host."""
    out = {}
    for d in ("etc/bpdkv", "etc/systemd/system", "opt/bpdkv/bin"):
        for path in sorted((host.fs / d).rglob("*")):
            if path.is_file() and not path.is_symlink() and path.name != "dirty":  # the marker is said apart
                out["/" + str(path.relative_to(host.fs))] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return out


@dataclass
class Injecting:
    """A real SSH connector whose commit script is rewritten by `rewrite` (a hook inside the real script)."""

    inner: Connector
    rewrite: Callable[[str], str]
    seen: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return self.inner.host

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        if COMMIT_MARK in command:
            self.seen.append(command)
            command = self.rewrite(command)
        return self.inner.run(command, timeout)

    def put(self, data: bytes, path: str) -> None:
        self.inner.put(data, path)

    def get(self, path: str) -> bytes:
        return self.inner.get(path)

    def close(self) -> None:
        self.inner.close()


WRITES = ("cp", "mv", "chmod", "chown", "mkdir", "sync", "touch", "rm", "printf")


def fault_at(counter: Path, k: int, action: str) -> Callable[[str], str]:
    """Shell functions in front of the real script: every write command counts itself (in `counter`, across the
    script's subshells); the k-th one fails as an I/O error would (`eio`) or kills the whole session (`kill`)."""
    fault = {
        "eio": 'echo "$0: $1: Input/output error" >&2; return 1',
        "kill": "kill -9 0",  # the session's whole process group, as a dropped session's SIGHUP would
    }[action]
    defs = [
        f'{name}() {{ n=$(( $(cat {counter}) + 1 )); echo $n > {counter}; if [ "$n" = {k} ]; then {fault}; fi; command {name} "$@"; }}'
        for name in WRITES
    ]
    return lambda script: "\n".join([f"echo 0 > {counter}", *defs, script])


@dataclass
class CommitLab:
    """host2 deployed at v1, a saved v2 plan for host2 alone, and a way back to v1 between cases (no re-apply)."""

    hosts: TestHosts
    fleet: Fleet
    plan: Plan
    v1: dict[str, tuple[bytes, int]]
    v2: dict[str, bytes]
    counter: Path

    @property
    def victim(self) -> TestHost:
        return self.hosts.hosts[1]

    def reset(self) -> None:
        fs = self.victim.fs
        for path in set(managed_files(self.victim)) - set(self.v1):
            (fs / path.lstrip("/")).unlink()
        for path, (data, mode) in self.v1.items():
            target = fs / path.lstrip("/")
            target.write_bytes(data)
            target.chmod(mode)
        subprocess.run(["rm", "-rf", str(fs / "var/lib/bpdkv/backup"), str(fs / "etc/bpdkv/dirty")], check=True)

    def apply(self, rewrite: Callable[[str], str]) -> tuple[Report, Injecting]:
        conn = Injecting(self.fleet.conns["host2"], rewrite)
        conns = dict(self.fleet.conns, host2=conn)
        fleet = Fleet(self.fleet.validated, self.fleet.artifacts, self.fleet.facts, conns, self.fleet.hardware)
        return apply_plan(fleet, self.plan, ApplyOptions(parallel=3, owner=lock_owner())), conn

    def each_file_is_v1_or_v2(self) -> dict[str, str]:
        """Which version each managed file is; fails on anything else (a truncated or half-written file)."""
        now = managed_files(self.victim)
        assert set(now) == set(self.v1), sorted(set(now) ^ set(self.v1))
        which = {}
        for path, (data, _) in now.items():
            if data == self.v1[path][0]:
                which[path] = "v1"
            elif data == self.v2.get(path) or (path.endswith("manifest.json") and json.loads(data)["generation"] == self.plan.generation):
                which[path] = "v2"
            else:
                raise AssertionError(f"{path} is neither v1 nor v2 ({len(data)} bytes): {data[:80]!r}")
        return which


@pytest.fixture
def commit_lab(hosts: TestHosts, tmp_path: Path) -> Iterator[CommitLab]:
    topo = write_topology(tmp_path / "t.yaml", doc_version(hosts, "v1"))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    v1 = managed_files(hosts.hosts[1])
    write_topology(topo, doc_version(hosts, "v2", unit_change=21))
    fleet = load_fleet(str(topo))
    try:
        plan = plan_fleet(fleet, False, 3, lambda node: SshConnector(node, SshOptions(command_timeout=20)), ("host2",))
        v2 = {a.path: a.content.encode() for a in fleet.artifacts if a.host == "host2"}
        assert [f.path for h in plan.hosts for f in h.files if f.action != "none"] == [
            "/etc/bpdkv/decode-0.env",
            "/etc/systemd/system/bpdkv-decode-0.service",
        ]
        yield CommitLab(hosts, fleet, plan, v1, v2, tmp_path / "writes")
    finally:
        fleet.close()


def count_writes(lab: CommitLab) -> int:
    """The commit's write commands, counted on a run with no fault (then undone)."""
    lab.reset()
    report, conn = lab.apply(fault_at(lab.counter, 0, "eio"))
    assert report.outcomes["host2"].status is HostStatus.APPLIED, report.to_json()
    changed = {f.path for h in lab.plan.hosts for f in h.files if f.action != "none"} | {"/etc/bpdkv/manifest.json"}
    assert len(conn.seen) == 1 and lab.each_file_is_v1_or_v2() == {p: "v2" if p in changed else "v1" for p in lab.v1}
    return int(lab.counter.read_text())


def test_a_fault_at_every_write_of_the_commit_loses_no_file(commit_lab: CommitLab) -> None:
    """An I/O error at each write command of the real commit script, one run each, and a killed session at each (CI:
    every third): after each, every managed file is byte-identical to v1 or v2; a host reported restored is all v1."""
    writes = count_writes(commit_lab)
    assert writes >= 15, writes  # backups (copy, fsync, compare, rename), staged fsyncs, renames, folders
    kills = range(1, writes + 1) if FULL else range(1, writes + 1, 3)
    cases = [(k, "eio") for k in range(1, writes + 1)] + [(k, "kill") for k in kills]
    for k, action in cases:
        commit_lab.reset()
        report, _ = commit_lab.apply(fault_at(commit_lab.counter, k, action))
        outcome = report.outcomes["host2"]
        which = commit_lab.each_file_is_v1_or_v2()
        assert report.exit_code == 1 and outcome.status is not HostStatus.APPLIED, (k, action, report.to_json())
        if outcome.status in (HostStatus.FAILED, HostStatus.ROLLED_BACK):
            assert set(which.values()) == {"v1"}, (k, action, which, outcome.message)  # "restored" means all of them
            if action == "eio":
                assert "Input/output error" in outcome.message or "does not match" in outcome.message, (k, outcome.message)
        else:
            assert outcome.status is HostStatus.DIRTY, (k, action, outcome)
        assert not list(commit_lab.victim.fs.rglob("*.bpdkv-new")), k  # no staged file stays
    commit_lab.reset()


def test_a_full_backup_disk_mid_commit_restores_every_byte(commit_lab: CommitLab) -> None:
    """A real ENOSPC: the backup folder becomes a one-page tmpfs after the plan was made (so preflight could not see
    it). The first backup fits, the second cannot be written: the commit stops before any rename and says restored,
    and it is: the live files are v1 to the byte (before the fix the env file was left at 0 bytes)."""
    lab = commit_lab
    lab.reset()
    backup = "/var/lib/bpdkv/backup"
    mounted = lab.hosts.exec(lab.victim, f"mkdir -p {backup} && mount -t tmpfs -o size=4k tmpfs {backup}")
    assert mounted.returncode == 0, mounted.stderr
    try:
        report, _ = lab.apply(lambda script: script)
    finally:
        lab.hosts.exec(lab.victim, f"umount {backup}")
    outcome = report.outcomes["host2"]
    assert outcome.status in (HostStatus.FAILED, HostStatus.ROLLED_BACK), report.to_json()
    assert "no space left on device" in outcome.message and "previous files restored" in outcome.message, outcome.message
    assert set(lab.each_file_is_v1_or_v2().values()) == {"v1"}
    assert version_of("10.213.0.12", 8200) == "v1"


def test_a_restore_that_cannot_finish_is_dirty_and_the_next_plan_repairs_it(commit_lab: CommitLab, tmp_path: Path) -> None:
    """The second rename fails and so does every copy of the restore after it: exit 2 of the script, reported dirty
    (never "restored"), the dirty marker written, and the next plan shows the repair; a rerun converges."""
    lab = commit_lab
    lab.reset()
    writes = count_writes(lab)
    lab.reset()
    second_rename = writes - 2  # the last writes: mv of the unit file, the folder fsync, touch .complete
    breaking = fault_at(lab.counter, second_rename, "eio")

    def and_restore_fails(script: str) -> str:
        # after the fault, every cp (the restore's copies) fails too
        return breaking(script).replace(
            "command cp ",
            f'[ "$(cat {lab.counter})" -gt {second_rename} ] && {{ echo "cp: Input/output error" >&2; return 1; }}; command cp ',
            1,
        )

    report, _ = lab.apply(and_restore_fails)
    outcome = report.outcomes["host2"]
    which = lab.each_file_is_v1_or_v2()
    assert outcome.status is HostStatus.DIRTY, report.to_json()
    assert "could not be restored" in outcome.message and "restored)" not in outcome.message, outcome.message
    assert which["/etc/bpdkv/decode-0.env"] == "v2" and which["/etc/systemd/system/bpdkv-decode-0.service"] == "v1"
    assert (lab.victim.fs / "etc/bpdkv/dirty").exists()
    topo = Path(lab.fleet.validated.file)
    replan = bpdkv("plan", str(topo), "--limit", "host2")
    said = " ".join(replan.stdout.split())
    assert replan.returncode == 2 and "repair: a previous apply could not restore this host" in said, replan.stdout + replan.stderr
    rerun = bpdkv("apply", str(topo), "-y")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert bpdkv("plan", str(topo)).returncode == 0 and version_of("10.213.0.12", 8200) == "v2"


def test_backup_folder_on_a_full_disk_is_refused_before_any_write(hosts: TestHosts, tmp_path: Path) -> None:
    topo = write_topology(tmp_path / "t.yaml", doc_version(hosts, "v1"))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    write_topology(topo, doc_version(hosts, "v2", unit_change=21))
    before = [managed_files(h) for h in hosts.hosts]
    backup = "/var/lib/bpdkv/backup"
    assert hosts.exec(hosts.hosts[1], f"mkdir -p {backup} && mount -t tmpfs -o size=16k tmpfs {backup}").returncode == 0
    try:
        refused = bpdkv("apply", str(topo), "-y")
    finally:
        hosts.exec(hosts.hosts[1], f"umount {backup}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"host2: disk: {backup}: " in refused.stderr and "backups " in refused.stderr, refused.stderr
    assert [managed_files(h) for h in hosts.hosts] == before  # nothing written on any host


# ---- item 3: every step's exit status ----------------------------------------------------------------------------


def test_a_failed_daemon_reload_fails_the_host_before_any_restart(hosts: TestHosts, tmp_path: Path) -> None:
    topo = write_topology(tmp_path / "t.yaml", doc_version(hosts, "v1"))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    write_topology(topo, doc_version(hosts, "v2", unit_change=21))
    victim = hosts.hosts[1]
    once = tmp_path / "reload-failed"
    wrapper = tmp_path / "systemctl"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = daemon-reload ] && [ ! -e {once} ]; then touch {once}; '
        'echo "Failed to reload daemon: Access denied" >&2; exit 1; fi\n'
        f'exec {hosts.base / "systemctl"} "$@"\n'
    )
    wrapper.chmod(0o755)
    assert hosts.exec(victim, f"mount --bind {wrapper} /usr/bin/systemctl").returncode == 0
    try:
        failed = bpdkv("apply", str(topo), "-y")
    finally:
        hosts.exec(victim, "umount /usr/bin/systemctl")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "host2: rolled back: systemctl daemon-reload exited 1: Failed to reload daemon: Access denied" in failed.stderr, failed.stderr
    assert version_of("10.213.0.12", 8200) == "v1"  # never restarted on the new files
    assert "FAKE_VERSION=v1" in (victim.fs / "etc/bpdkv/decode-0.env").read_text()
    assert version_of("10.213.0.11", 8100) == "v2"
    rerun = bpdkv("apply", str(topo), "-y")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert version_of("10.213.0.12", 8200) == "v2"


# ---- item 2: a host that stops answering, at several moments --------------------------------------------------


COMMAND_TIMEOUT = 4.0
CONNECT_TIMEOUT = 3.0  # topology_doc's ssh.connect_timeout
BOUND = COMMAND_TIMEOUT + min(COMMAND_TIMEOUT, 15.0) + CONNECT_TIMEOUT  # docs/deploy.md: <= 3 x --command-timeout


def sshd_pids(hosts: TestHosts, host: TestHost) -> list[str]:
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sshd":
                out.append(pid)
        except OSError:
            pass
    return out


def _parent(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


class Fault:
    """How a host stops answering, and how it comes back. Every process signalled is the lab's own sshd."""

    def __init__(self, hosts: TestHosts, host: TestHost, kind: str) -> None:
        self.hosts, self.host, self.kind = hosts, host, kind
        self.frozen: list[str] = []

    def start(self) -> None:
        if self.kind == "frozen":  # the listener and every session process: nothing answers, TCP stays up
            self.frozen = sshd_pids(self.hosts, self.host)
            subprocess.run(["kill", "-STOP", *self.frozen], check=True)
        elif self.kind == "link-down":
            subprocess.run(["ip", "-n", self.host.name, "link", "set", "eth0", "down"], check=True)
        else:  # half-open: the host's answers vanish, then its side of the connection is gone without a word
            subprocess.run(["ip", "-n", self.host.name, "route", "add", "blackhole", "10.213.0.1/32"], check=True)
            sshd = sshd_pids(self.hosts, self.host)
            sessions = [p for p in sshd if _parent(p) in sshd]  # not the listener (its parent is the host's init)
            if sessions:
                subprocess.run(["kill", "-KILL", *sessions], capture_output=True)

    def stop(self) -> None:
        if self.kind == "frozen":
            subprocess.run(["kill", "-CONT", *self.frozen], capture_output=True)
        elif self.kind == "link-down":
            subprocess.run(["ip", "-n", self.host.name, "link", "set", "eth0", "up"], capture_output=True)
        else:
            subprocess.run(["ip", "-n", self.host.name, "route", "del", "blackhole", "10.213.0.1/32"], capture_output=True)


# (moment, what marks it on host2): before the commit (a staged upload), inside the commit script, between the waves
# (host2's decode restart, after the prefill wave), during a health gate (the probe command runs while it happens).
MOMENTS = {
    "staging": ("put", ".env.bpdkv-new", 0.0),
    "commit": ("run", COMMIT_MARK, 0.5),  # the script pauses 1.5 s after its first rename (below): mid-commit
    "between-waves": ("run", "systemctl enable bpdkv-decode-0", 0.0),
    "gate": ("run", "urllib.request", 0.0),
}


def pause_after_first_rename(script: str) -> str:
    lines = script.splitlines()
    first = next(i for i, line in enumerate(lines) if "mv -f" in line and ".bpdkv-new" in line and "chmod" in line)
    return "\n".join([*lines[: first + 1], "sleep 1.5", *lines[first + 1 :]])


CASES = [("frozen", "between-waves"), ("link-down", "commit"), ("half-open", "gate")]
if os.environ.get("BPDKV_STALL_CASES"):  # e.g. half-open:gate,frozen:staging (one case at a time while debugging)
    CASES = [(k, m) for k, _, m in (c.partition(":") for c in os.environ["BPDKV_STALL_CASES"].split(","))]
if FULL:
    CASES = [(k, m) for k in ("frozen", "link-down", "half-open") for m in MOMENTS]


@dataclass
class Stalling:
    """A real connector that sets off `fault` at the first step matching `needle` (after `delay` s, in a thread: the step
    is under way when the host stops answering), and notes when it did."""

    inner: Connector
    kind: str
    needle: str
    delay: float
    fault: Fault
    when: list[float] = field(default_factory=list)
    calls: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of every step on the host

    def meets_silence(self) -> float:
        """When a step first found the host not answering: the fault's moment if a step was under way then, else the
        start of the next step (the bound runs from there: docs/deploy.md)."""
        hit = self.when[0]
        if any(start <= hit <= end for start, end in self.calls):
            return hit
        return min((start for start, _ in self.calls if start >= hit), default=hit)

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            return call()
        finally:
            self.calls.append((start, time.monotonic()))

    @property
    def host(self) -> str:
        return self.inner.host

    def _trip(self, text: str) -> None:
        if self.when or self.needle not in text:
            return
        self.when.append(time.monotonic() + self.delay)
        if self.delay:
            threading.Timer(self.delay, self.fault.start).start()
        else:
            self.fault.start()

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        if self.kind == "run":
            self._trip(command)
            if COMMIT_MARK in command and self.needle == COMMIT_MARK:
                command = pause_after_first_rename(command)
        result: CommandResult = self._timed(lambda: self.inner.run(command, timeout))
        return result

    def put(self, data: bytes, path: str) -> None:
        if self.kind == "put":
            self._trip(path)
        self._timed(lambda: self.inner.put(data, path))

    def get(self, path: str) -> bytes:
        return self.inner.get(path)

    def close(self) -> None:
        self.inner.close()


def stall_once(hosts: TestHosts, topo: Path, kind: str, moment: str, version: str) -> None:
    """One apply to `version` during which host2 stops answering at `moment`; what it must say, and how fast."""
    victim = hosts.hosts[1]
    options = SshOptions(command_timeout=COMMAND_TIMEOUT)
    fault = Fault(hosts, victim, kind)
    how, needle, delay = MOMENTS[moment]
    stalled: list[Stalling] = []
    decided: dict[str, float] = {}

    def connect(node: Node) -> Any:
        inner = SshConnector(node, options)
        if node.name != "host2":
            return inner
        stalled.append(Stalling(inner, how, needle, delay, fault))
        return stalled[-1]

    timeline: list[tuple[float, str]] = []

    def progress(host: str, message: str) -> None:
        if host == "host2":
            timeline.append((time.monotonic(), message[:160]))
        if host == "host2" and message.startswith(("failed:", "rolled back", "dirty:")):
            decided[message.split(":")[0]] = time.monotonic()

    fleet = load_fleet(str(topo))
    try:
        plan = plan_fleet(fleet, False, 3, connect, owner=lock_owner(), force_unlock=True)
        started = time.monotonic()
        report = apply_plan(fleet, plan, ApplyOptions(parallel=3, owner=lock_owner()), progress)
        ended = time.monotonic()
    finally:
        fault.stop()
        fleet.close()
    case = f"{kind} at {moment}"
    outcome = report.outcomes["host2"]
    assert stalled and stalled[0].when, f"{case}: the fault never set off"
    hit = stalled[0].meets_silence()
    assert report.exit_code == 1, (case, report.to_json())
    assert outcome.status in (HostStatus.FAILED, HostStatus.ROLLED_BACK, HostStatus.DIRTY), (case, report.to_json())
    assert "answer" in outcome.message, (case, outcome.message)  # "stopped answering" / "no answer"
    gave_up = max(decided.values()) if decided else ended
    said = "; ".join(f"{t - hit:+.1f}s {m}" for t, m in timeline)
    assert gave_up - hit <= BOUND + 2.0, f"{case}: host2 decided {gave_up - hit:.1f}s after it stopped answering (bound {BOUND:g}s): {said}"
    assert ended - started < 120, case
    assert report.outcomes["host1"].status is HostStatus.APPLIED and version_of("10.213.0.11", 8100) == version, case
    assert "host2" in "\n".join(report.failed_lines()), case
    print(f"{case}: host2 {outcome.status.value} {gave_up - hit:.1f}s after the fault (bound {BOUND:g}s); apply {ended - started:.1f}s")


def test_a_host_that_stops_answering_is_given_up_on_within_the_bound(hosts: TestHosts, tmp_path: Path) -> None:
    topo = write_topology(tmp_path / "t.yaml", doc_version(hosts, "v1"))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    for n, (kind, moment) in enumerate(CASES, start=2):
        write_topology(topo, doc_version(hosts, f"v{n}", unit_change=20 + n))
        stall_once(hosts, topo, kind, moment, f"v{n}")
    final = bpdkv("apply", str(topo), "-y", "--force-unlock")  # host2 comes back: the next apply repairs it
    assert final.returncode == 0, final.stdout + final.stderr
    assert bpdkv("plan", str(topo)).returncode == 0
