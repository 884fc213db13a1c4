"""Interpret a Plan's operations and report outcomes: locks, packages, staged files committed by the plan's commit
script, daemon-reload, unit waves (drain → start → gate → undrain), probe pulls, rollback per host or per P/D
generation by each operation's Undo, manifest last, locks released. Every shell command sent is one an operation
holds (operations.shell_commands); the runner decides only order, parallelism and what a failure rolls back.

Only `ConnectorError` (a transport failure) becomes a per-host outcome here. Any other exception is a bug: the host
fails with the traceback in its log, the command exits 1, and the host is rolled back like any failed one.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from hashlib import sha256
from pathlib import Path
from typing import Any, TypeVar

from bpdkv.deploy import efa, linkseed
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import check_installed, install_command
from bpdkv.deploy.connectors import Connector, ConnectorError, plain_errno, probe, run_checked, run_step
from bpdkv.deploy.facts import MANIFEST_PATH, NODE_WHEELHOUSE, HostFacts
from bpdkv.deploy.operations import TMP_SUFFIX
from bpdkv.deploy.planner import HostPlan, Plan, manifest_for
from bpdkv.errors import BpdkvError
from bpdkv.render import STOP_TIMEOUT, Artifact
from bpdkv.topology.model import Topology

log = logging.getLogger("bpdkv.deploy")

INSTALL_TIMEOUT = 3600.0  # seconds for one node's pip install: vLLM + torch from a wheelhouse take minutes
DRAIN_TIMEOUT = 120.0
# A restart waits for the stop (systemd's TimeoutStopSec, then SIGKILL) before it starts: more than the connector's
# default command timeout may pass on a loaded node (a rollback then failed with "exited -1" and left the host dirty).
UNIT_COMMAND_TIMEOUT = STOP_TIMEOUT + 60.0
DRAIN_DONE = ("drained", "unhealthy")  # router upstream states (GET /admin/upstreams) in which a drain has nothing to wait for
T = TypeVar("T")


class HostStatus(str, Enum):
    UNCHANGED = "unchanged"
    APPLIED = "applied"
    SKIPPED = "skipped"  # left out by --limit
    NOT_STARTED = "not started"  # preflight failed somewhere: nothing written on this host
    ROLLED_BACK = "rolled back"  # failed, previous files and units serve again
    FAILED = "failed"  # failed before anything was changed on it (or its change was undone before commit)
    DIRTY = "dirty"  # failed and could not be restored: the next plan shows it and apply repairs it
    PAUSED = "paused"  # a roll stopped on it without undoing it (its generation is the only one serving): apply resumes

    @property
    def ok(self) -> bool:
        return self in (HostStatus.UNCHANGED, HostStatus.APPLIED, HostStatus.SKIPPED)


@dataclass
class HostOutcome:
    host: str
    status: HostStatus = HostStatus.UNCHANGED
    message: str = ""
    files_written: int = 0
    units_restarted: list[str] = field(default_factory=list)
    traceback: str = ""  # set when a bug (not a transport error) failed the host


@dataclass
class Report:
    """Owns per-host outcomes and the exit code: 0 when every host is applied/unchanged/skipped, else 1."""

    outcomes: dict[str, HostOutcome]
    problems: list[str] = field(default_factory=list)  # preflight lines (nothing was written)
    summary: list[str] = field(default_factory=list)  # a roll's last lines: what each step did, what serves per generation

    @property
    def exit_code(self) -> int:
        return 0 if not self.problems and all(o.status.ok for o in self.outcomes.values()) else 1

    def failed_lines(self) -> list[str]:
        lines = list(self.problems)
        for o in self.outcomes.values():
            if not o.status.ok and o.status is not HostStatus.NOT_STARTED:
                lines.append(f"{o.host}: {o.status.value}: {o.message}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "problems": self.problems,
            "summary": self.summary,
            "hosts": [
                {
                    "host": o.host,
                    "status": o.status.value,
                    "message": o.message,
                    "files_written": o.files_written,
                    "units_restarted": o.units_restarted,
                }
                for o in self.outcomes.values()
            ],
        }


@dataclass(frozen=True)
class PackageSource:
    """What the bootstrap pushes: a wheelhouse (offline, --no-index) or just bpdkv's own wheel (deps from the index)."""

    files: dict[str, Path]  # wheel name → local path
    bpdkv_wheel: str
    offline: bool


@dataclass(frozen=True)
class ApplyOptions:
    parallel: int = 8
    max_unavailable: int = 1
    owner: str = ""  # lock owner text: user@machine pid N
    drain_timeout: float = DRAIN_TIMEOUT


Progress = Callable[[str, str], None]  # (host, message)


class PlanMismatch(BpdkvError):
    """The saved operations do not match what was rendered (a bug or a tampered plan file)."""


def for_each_host(items: Sequence[T], fn: Callable[[T], Any], parallel: int) -> list[Any]:
    """fn per item in parallel threads; results in input order. Exceptions propagate (callers guard per host)."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(items)))) as pool:
        return list(pool.map(fn, items))


class Runner:
    def __init__(
        self,
        topology: Topology,
        artifacts: list[Artifact],
        plan: Plan,
        conns: dict[str, Connector],
        options: ApplyOptions,
        progress: Progress | None = None,
        packages: PackageSource | None = None,
        facts: dict[str, HostFacts] | None = None,
    ) -> None:
        self.topology = topology
        self.artifacts = artifacts
        self.plan = plan
        self.conns = conns
        self.options = options
        self.progress = progress or (lambda host, msg: None)
        self.packages = packages
        self.facts = facts or {}
        self.report = Report({h.host: HostOutcome(h.host) for h in plan.hosts})
        self._links_measured: set[ops.MeasureLinks] = set()  # measure_links: each operation once (plain waves, then a roll)
        self.committed: set[str] = set()  # hosts whose new files are in place (rollback must restore them)
        self.started: dict[str, list[ops.StartUnit]] = {}  # units this run (re)started, per host
        self.locked: set[str] = set()
        self.in_roll_step = False  # a failing host of a cohort step is rolled back (or paused) by run_roll, not by fail()

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def outcome(self, host: str) -> HostOutcome:
        return self.report.outcomes[host]

    def alive(self, host: str) -> bool:
        return self.outcome(host).status in (HostStatus.UNCHANGED, HostStatus.APPLIED)

    def guarded(self, step: Callable[[HostPlan], None]) -> Callable[[HostPlan], None]:
        """Run one step on one host; a failure fails only that host (and rolls it back), never the process."""

        def inner(hp: HostPlan) -> None:
            if not self.alive(hp.host):
                return
            try:
                step(hp)
            except ConnectorError as exc:
                self.fail(hp, exc.reason)
            except Exception as exc:  # noqa: BLE001 - a bug: fail this host loudly with its traceback, never report success
                trace = traceback.format_exc()
                log.error("%s: internal error\n%s", hp.host, trace)
                self.fail(hp, f"internal error ({type(exc).__name__}: {exc}); traceback in the log", trace)

        return inner

    def fail(self, hp: HostPlan, message: str, trace: str = "") -> None:
        out = self.outcome(hp.host)
        out.status = HostStatus.FAILED
        out.message = message
        out.traceback = trace or out.traceback
        self.progress(hp.host, f"failed: {message}")
        if self.in_roll_step:
            return  # run_roll decides: roll the step back, or pause it where its generation is the only one serving
        if hp.host in self.committed or self.started.get(hp.host):
            self.rollback([hp], message)

    # ---- locks -----------------------------------------------------------------------------------------------------
    def lock_all(self, hosts: list[HostPlan]) -> list[str]:
        """Each host's Lock operation before anything is written; on any refusal release those taken and say who holds it."""

        def one(hp: HostPlan) -> str | None:
            lock = _first(hp, ops.Lock)
            if lock is None:
                return None  # nothing to lock: the plan has no operations for it
            try:
                result = self.conns[hp.host].run(lock.command(self.options.owner))
            except ConnectorError as exc:
                return exc.reason
            if result.exited == 0:
                self.locked.add(hp.host)
                return None
            try:
                held = json.loads(result.stdout.strip().splitlines()[-1])
                return f"lock: another apply holds it: {held.get('owner')} since {held.get('started')} (topology {held.get('topology')})"
            except (ValueError, IndexError, AttributeError):
                return f"lock: {lock.path} could not be taken: {(result.stderr or result.stdout).strip()[-200:]}"

        results = for_each_host(hosts, one, self.options.parallel)
        refused = [f"{hp.host}: {why}" for hp, why in zip(hosts, results, strict=True) if why]
        if refused:
            self.unlock_all()
        return refused

    def unlock_all(self) -> None:
        plans = {hp.host: hp for hp in self.plan.hosts}

        def one(host: str) -> None:
            unlock = _first(plans[host], ops.Unlock)
            if unlock is None:
                return
            try:
                run_step(self.conns[host], unlock.command(self.options.owner), "lock release")
            except ConnectorError as exc:
                self.progress(host, f"could not release the lock ({exc.reason}); `apply --force-unlock` removes it")
                self.report.problems.append(
                    f"{host}: the lock {unlock.path} could not be released ({exc.reason}); `apply --force-unlock` removes it"
                )

        for_each_host(sorted(self.locked), one, self.options.parallel)
        self.locked.clear()

    # ---- per-host phases -------------------------------------------------------------------------------------------
    def install(self, hp: HostPlan) -> None:
        for op in hp.operations:
            if isinstance(op, ops.InstallSystemPackages):
                self.progress(hp.host, ops.describe(op))
                result = self.conns[hp.host].run(op.command(), INSTALL_TIMEOUT)
                if result.exited != 0:
                    said = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
                    # apt-get's reason is its "E: ..." line; warnings (W:) and progress come before it.
                    reason = next((line for line in reversed(said) if line.startswith("E:")), said[-1] if said else "no output")
                    raise ConnectorError(
                        hp.host, f"apt-get install {' '.join(op.packages)} failed (exit {result.exited}): {plain_errno(reason)}"
                    )
            elif isinstance(op, ops.InstallPackages):
                self.install_packages(hp, op)

    def install_packages(self, hp: HostPlan, op: ops.InstallPackages) -> None:
        """Bootstrap: push missing wheels, make/upgrade the venv, install, verify imports and versions, record bpdkv."""
        if self.packages is None:
            raise ConnectorError(hp.host, "packages must be installed but no package source was prepared")
        conn = self.conns[hp.host]
        node = next(n for n in self.topology.nodes if n.name == hp.host)
        facts = self.facts.get(hp.host)
        have = facts.wheelhouse if facts else {}
        run_checked(conn, op.mkdir_command())
        pushed = 0
        for name, local in sorted(self.packages.files.items()):
            if have.get(name) == local.stat().st_size and name != self.packages.bpdkv_wheel:
                continue  # already there (wheel names carry versions; bpdkv's own is rebuilt under one name)
            conn.put(local.read_bytes(), f"{NODE_WHEELHOUSE}/{name}")
            pushed += 1
        self.progress(hp.host, f"pushed {pushed} wheel(s); installing " + ", ".join(op.lines))
        wheel = f"{NODE_WHEELHOUSE}/{self.packages.bpdkv_wheel}"
        command = install_command(self.topology, node, wheel, self.packages.offline)
        result = conn.run("sh -c " + shlex.quote(command), INSTALL_TIMEOUT)
        lines = result.stdout.strip().splitlines()
        try:
            report = json.loads(lines[-1]) if result.exited == 0 and lines else None
        except ValueError:
            report = None
        if report is None:
            tail = (result.stderr or result.stdout).strip().splitlines()
            raise ConnectorError(hp.host, f"package install failed (exit {result.exited}): {tail[-1] if tail else 'no output'}")
        problems = check_installed(self.topology, node, report)
        if problems:
            raise ConnectorError(hp.host, "installed packages do not verify: " + "; ".join(problems))
        run_checked(conn, op.record_command())
        self.progress(hp.host, "verified: " + ", ".join(f"{k} {v}" for k, v in sorted(report.get("versions", {}).items())))

    def stop_removed(self, hp: HostPlan) -> None:
        for op in hp.operations:
            if isinstance(op, ops.StopUnit):
                run_step(self.conns[hp.host], op.command(), f"systemctl stop {op.unit}", UNIT_COMMAND_TIMEOUT)
                self.progress(hp.host, f"stopped {op.unit}")

    def stage(self, hp: HostPlan) -> None:
        """The Stage operation, then every new file uploaded beside its target; nothing the host runs changes yet."""
        uploads = [op for op in hp.operations if isinstance(op, ops.UploadFile)]
        contents = {a.path: a for a in self.artifacts if a.host == hp.host}
        conn = self.conns[hp.host]
        for op in hp.operations:
            if isinstance(op, ops.Stage):
                for command in op.commands():
                    run_checked(conn, command)
        try:
            for upload in uploads:
                art = contents.get(upload.path)
                data = art.content.encode() if art else b""
                if art is None or sha256(data).hexdigest() != upload.sha256:
                    raise PlanMismatch(f"{hp.host}: {upload.path}: the rendered file is not the one the plan holds (sha256 differs)")
                conn.put(data, upload.path + TMP_SUFFIX)
        except BaseException:
            self.remove_temps(hp)
            raise

    def remove_temps(self, hp: HostPlan) -> None:
        cleanup = _first(hp, ops.RemoveStaged)
        if cleanup is None:
            return
        try:
            run_step(self.conns[hp.host], cleanup.command(), "removing the staged files")
        except ConnectorError as exc:
            self.progress(hp.host, f"could not remove temp files ({exc.reason})")
            self.report.problems.append(f"{hp.host}: staged files (*{TMP_SUFFIX}) may be left behind: {exc.reason}")

    def commit(self, hp: HostPlan) -> None:
        """Back up every file about to change, then rename the staged files into place, in one shell script that puts the
        previous files back itself if any step fails (and marks the host dirty if even that fails)."""
        changes = [op for op in hp.operations if isinstance(op, ops.UploadFile | ops.DeleteFile)]
        conn = self.conns[hp.host]
        commit = _first(hp, ops.Commit)
        if changes and commit is None:
            raise PlanMismatch(f"{hp.host}: the plan changes files but holds no commit operation")
        if commit is not None:
            self.committed.add(hp.host)  # from here on, a failure restores the backup
            result = conn.run(commit.script)
            if result.exited != 0:
                said = (result.stderr or result.stdout).strip().splitlines()
                detail = said[-1] if said else f"exit {result.exited}"
                if result.exited == 2:
                    self.committed.discard(hp.host)
                    out = self.outcome(hp.host)
                    out.status, out.message = (
                        HostStatus.DIRTY,
                        f"commit failed and the previous files could not be restored: {plain_errno(detail)}; the next plan shows the repair",
                    )
                    self.progress(hp.host, f"dirty: {out.message}")
                    return
                if result.exited != 1:
                    # Killed or cut off mid-script (no exit status, a signal): some files may be renamed, none restored.
                    # Stay committed, so fail() runs the restore, which is safe to repeat; if the host is gone, it is dirty.
                    raise ConnectorError(hp.host, f"commit script ended without finishing (exit {result.exited}): {plain_errno(detail)}")
                self.committed.discard(hp.host)  # the script restored the previous files itself
                raise ConnectorError(hp.host, f"commit of new files failed (previous files restored): {plain_errno(detail)}")
            self.outcome(hp.host).files_written = len(changes)
            for change in changes:
                self.progress(hp.host, f"{'-' if isinstance(change, ops.DeleteFile) else '+'} {change.path}")
        if any(isinstance(op, ops.DaemonReload) for op in hp.operations):
            # Still committed: a failed reload fails the host here, before any unit restarts, and fail() restores it.
            run_step(conn, ops.DaemonReload().command(), "systemctl daemon-reload")

    def finish(self, hp: HostPlan) -> None:
        """Last: clean-up commands (destroy) and the manifest, which records what the host now runs."""
        for op in hp.operations:
            if isinstance(op, ops.RunCommand):
                run_checked(self.conns[hp.host], op.command)
                self.progress(hp.host, op.description)
            elif isinstance(op, ops.WriteManifest):
                self.write_manifest(hp, op)
        self.outcome(hp.host).status = HostStatus.APPLIED

    def write_manifest(self, hp: HostPlan, op: ops.WriteManifest) -> None:
        manifest = manifest_for(self.topology, hp.host, self.artifacts, self.plan.generation)
        digest = sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        if digest != op.sha256 or sha256(json.dumps(json.loads(op.content or "null"), sort_keys=True).encode()).hexdigest() != digest:
            raise PlanMismatch(f"{hp.host}: the manifest differs from the one the plan holds")
        conn = self.conns[hp.host]
        run_checked(conn, op.mkdir_command())
        conn.put(op.content.encode(), MANIFEST_PATH + TMP_SUFFIX)
        run_checked(conn, op.command())

    # ---- units -----------------------------------------------------------------------------------------------------
    def unit_steps(self, role: str) -> list[tuple[HostPlan, list[ops.Operation]]]:
        """Per unit of `role`: its drain, start, gate and undrain operations, in plan order."""
        steps: list[tuple[HostPlan, list[ops.Operation]]] = []
        for hp in self.plan.hosts:
            current: list[ops.Operation] | None = None
            for op in hp.operations:
                if isinstance(op, ops.Drain) or (isinstance(op, ops.StartUnit) and not (current and isinstance(current[-1], ops.Drain))):
                    current = [op]
                    steps.append((hp, current))
                elif isinstance(op, ops.StartUnit | ops.HealthGate | ops.Undrain) and current is not None:
                    current.append(op)
                else:
                    current = None
        return [(hp, step) for hp, step in steps if any(isinstance(op, ops.StartUnit) and op.role == role for op in step)]

    def run_unit(self, hp: HostPlan, step: list[ops.Operation]) -> str | None:
        """Drain, (re)start, gate, undrain. Returns why it failed, or None. ConnectorErrors propagate."""
        for op in step:
            if isinstance(op, ops.Drain):
                self.drain(op)
                self.progress(hp.host, f"drained {op.instance}")
            elif isinstance(op, ops.StartUnit):
                self.started.setdefault(hp.host, []).append(op)
                result = self.conns[hp.host].run(op.command(), UNIT_COMMAND_TIMEOUT)
                if result.exited != 0:
                    return f"{op.unit}: systemctl {'restart' if op.restart else 'start'} exited {result.exited}: {(result.stderr or result.stdout).strip()[-300:]}"
                self.progress(hp.host, f"{'restarted' if op.restart else 'started'} {op.unit}; waiting for health")
            elif isinstance(op, ops.HealthGate):
                answer = probe(self.conns[hp.host], op.base, list(op.paths), op.timeout)
                if answer.failure:
                    return f"{op.unit}: health gate failed after {op.timeout:g}s ({answer.failure})"
                if op.efa_check:
                    log_command, processes_command = op.efa_commands()
                    problem = efa.check_log(self.last_log_lines(hp, log_command))
                    # Beyond the log: what the unit's processes really mapped (plugin, libfabric) and their memlock.
                    problem = problem or efa.check_processes(self.conns[hp.host].run(processes_command).stdout)
                    if problem:
                        return f"{op.unit}: EFA check failed: {problem}"
                self.outcome(hp.host).units_restarted.append(op.unit)
            elif isinstance(op, ops.Undrain):
                self.admin(op, "undrain")
                self.progress(hp.host, f"undrained {op.instance}")
        return None

    def admin(self, op: ops.Drain | ops.Undrain, action: str) -> dict[str, Any]:
        """One call to the router's admin API as the operation names it, made on the router node (jump hosts and private
        subnets work)."""
        conn = self.conns.get(op.router_host)
        if conn is None:
            raise ConnectorError(op.router_host, f"router admin API: no connection to the router node to {action} {op.instance}")
        path = f"/admin/upstreams/{op.instance}/{action}" if action else "/admin/upstreams"
        answer = probe(conn, op.admin_base, [path], 10.0, method="POST" if action else "GET", once=True, bearer_file=op.key_file)
        if answer.failure:
            raise ConnectorError(op.router_host, f"router admin API {action or 'list'} of {op.instance} failed: {answer.failure}")
        try:
            data: dict[str, Any] = json.loads(answer.body)
        except ValueError:
            raise ConnectorError(op.router_host, f"router admin API {action or 'list'} answered no JSON: {answer.body[:120]!r}") from None
        return data

    def drain(self, op: ops.Drain) -> None:
        """Drain and wait until nothing of it is in flight. An instance the router does not route to (a spare restarted
        by a killed roll before its surge put it in the router's config) has nothing to drain."""
        listed = any(u.get("name") == op.instance for u in self.admin(op, "").get("upstreams", []))
        if not listed:
            return
        self.admin(op, "drain")
        deadline = time.monotonic() + self.options.drain_timeout
        while True:
            listing = self.admin(op, "")
            entry = next((u for u in listing.get("upstreams", []) if u.get("name") == op.instance), None)
            state = entry.get("state") if entry is not None else None
            if state in DRAIN_DONE:
                return
            # An engine the router refuses (another release than its generation: a killed roll restarted it) gets no
            # new request whatever its drain; once nothing of it is in flight there is nothing left to wait for.
            if state == "mismatched" and not (entry or {}).get("in_flight"):
                return
            if state is None:
                raise ConnectorError(op.router_host, f"router admin API does not list {op.instance}")
            if time.monotonic() >= deadline:
                raise ConnectorError(op.router_host, f"{op.instance} still {state} after {self.options.drain_timeout:g}s of draining")
            time.sleep(0.2)

    def last_log_lines(self, hp: HostPlan, command: str) -> str:
        """A unit's log lines (its operation's read-only `log_command`), or nothing when the host cannot say."""
        try:
            return self.conns[hp.host].run(command).stdout.strip()
        except ConnectorError:
            return ""

    # ---- rollback --------------------------------------------------------------------------------------------------
    def rollback(self, hosts: list[HostPlan], why: str) -> None:
        """Each operation this run did on the host undone as its `undo` says, in this order: the commit (restore script,
        daemon-reload), the units it (re)started (new ones stopped, others restarted on the restored files), the drains
        (undrained; one never reached answers an error, ignored). A failure of any of them: the host is dirty."""
        for hp in hosts:
            out = self.outcome(hp.host)
            commit = _first(hp, ops.Commit)
            done: list[ops.Operation] = [commit] if commit is not None and hp.host in self.committed else []
            done += self.started.pop(hp.host, [])
            done += [op for op in hp.operations if isinstance(op, ops.Drain)]
            try:
                for op in done:
                    self.undo(hp, op)
            except Exception as exc:  # noqa: BLE001 - whatever stopped the restore, the host must be recorded dirty
                out.status = HostStatus.DIRTY
                said = exc.reason if isinstance(exc, ConnectorError) else f"{type(exc).__name__}: {exc}"
                out.message = f"{why}; rollback failed ({said}); the next plan shows the repair"
                self.mark_dirty(hp)
                self.progress(hp.host, f"dirty: {out.message}")
                continue
            if out.status is not HostStatus.DIRTY:
                out.status = HostStatus.ROLLED_BACK
                out.message = f"{out.message or why}; rolled back to the previous files and units"
            self.progress(hp.host, "rolled back to the previous files and units")

    def undo(self, hp: HostPlan, op: ops.Operation) -> None:
        """One operation's undo (ops.Undo). ConnectorErrors propagate, except an undrain's."""
        conn = self.conns[hp.host]
        if isinstance(op, ops.Commit) and op.undo is ops.Undo.RESTORE_BACKUP:
            result = conn.run(op.restore)
            if result.exited != 0:
                raise ConnectorError(hp.host, f"restore failed: {(result.stderr or result.stdout).strip()[-200:]}")
            self.committed.discard(hp.host)
            run_step(conn, ops.DaemonReload().command(), "systemctl daemon-reload")
        elif isinstance(op, ops.StartUnit) and op.undo in (ops.Undo.STOP_UNIT, ops.Undo.RESTART_PREVIOUS):
            what = f"systemctl stop {op.unit}" if op.undo is ops.Undo.STOP_UNIT else f"systemctl restart {op.unit} (previous files)"
            run_step(conn, op.undo_command(), what, UNIT_COMMAND_TIMEOUT)
        elif isinstance(op, ops.Drain) and op.undo is ops.Undo.UNDRAIN:
            try:
                self.admin(op, "undrain")
            except ConnectorError:
                pass  # the instance may never have been drained; the failure itself is already reported
        else:
            raise PlanMismatch(f"{hp.host}: no undo for {ops.describe(op)} ({op.undo.value})")

    def mark_dirty(self, hp: HostPlan) -> None:
        marker = _first(hp, ops.MarkDirty)
        if marker is None:
            return
        try:
            run_step(self.conns[hp.host], marker.command(), "dirty marker")
        except Exception as exc:  # noqa: BLE001 - the host is down; its manifest still disagrees with its files, which plan sees
            said = exc.reason if isinstance(exc, ConnectorError) else str(exc)
            self.progress(hp.host, f"could not write the dirty marker {marker.path} ({said})")

    # ---- the whole run ---------------------------------------------------------------------------------------------
    def run(self) -> Report:
        live = [h for h in self.plan.hosts if h.changed and not h.skipped]
        for h in self.plan.hosts:
            if h.skipped:
                self.outcome(h.host).status = HostStatus.SKIPPED
        if not live:
            return self.report
        refused = self.lock_all(live)
        if refused:
            self.report.problems = refused
            for h in live:
                self.outcome(h.host).status = HostStatus.NOT_STARTED
            return self.report
        try:
            self._run(live)
        finally:
            for h in live:
                if h.host in self.committed and self.outcome(h.host).status is HostStatus.FAILED:
                    self.rollback([h], self.outcome(h.host).message)
            for_each_host(live, self.remove_temps, self.options.parallel)
            self.unlock_all()
        return self.report

    def _run(self, live: list[HostPlan]) -> None:
        if self.plan.roll is not None:
            self.run_roll(live)
            return
        self._run_waves(live)

    def _run_waves(self, live: list[HostPlan]) -> None:
        parallel = self.options.parallel
        # Packages first: a host whose install fails keeps its old files and units (nothing half-deployed).
        for_each_host(live, self.guarded(self.install), parallel)
        for_each_host(live, self.guarded(self.stop_removed), parallel)
        for_each_host(live, self.guarded(self.stage), parallel)
        for_each_host(live, self.guarded(self.commit), parallel)
        group = set(self.plan.group)
        for role in ("prefill", "decode", "router"):
            steps = [(hp, step) for hp, step in self.unit_steps(role) if any(h.host == hp.host for h in live)]
            size = max(1, self.options.max_unavailable)
            for start in range(0, len(steps), size):
                batch = [(hp, step) for hp, step in steps[start : start + size] if self.alive(hp.host)]
                results = for_each_host(batch, self._guarded_unit, parallel)
                for (hp, _), failure in zip(batch, results, strict=True):
                    if failure is None:
                        continue
                    if hp.host in group:
                        self.fail_generation([h for h in live if h.host in group], hp, failure)
                    else:
                        logs = self.last_log_lines(hp, _start(_).log_command())
                        tail = " | ".join(line for line in logs.splitlines()[-5:] if line.strip())
                        self.fail(hp, failure + (f"; last log lines: {tail}" if tail else ""))
        self.probe_pulls(live)
        self.measure_links(live)
        for_each_host([h for h in live if self.alive(h.host)], self.guarded(self.finish), parallel)

    # ---- cohort apply (bpdkv/deploy/cohorts.py) -------------------------------------------------------------------
    def run_roll(self, live: list[HostPlan]) -> None:
        """A compatibility break, cohort step by cohort step: the router learns both generations (and every node that
        serves during step 1 is undrained: a killed apply may have left one drained), then each step drains its nodes,
        installs, commits, restarts and gates them, probes a pull inside the new generation, has the router serve them
        there and checks that the router reports them serving. A step that fails is rolled back (its nodes on their
        previous files, the router on the config of the step before) and the roll stops there — unless the new
        generation is the only one serving: then nothing is undone, the roll pauses and says so (apply resumes it). The
        nodes of later steps are untouched. The other hosts (the router's) go last. The report's last lines say what
        each step did and what serves per generation."""
        roll = self.plan.roll
        assert roll is not None
        by_host = {hp.host: hp for hp in live}
        in_roll = {h for s in roll.steps for h in s.step.nodes}
        router_host = roll.prepare.host
        failure = self.router_stage(roll.prepare)
        if not failure:
            try:
                for undrain in roll.undrains:
                    self.admin(undrain, "undrain")
            except ConnectorError as exc:
                failure = exc.reason
        if failure:
            self.report.problems.append(f"{router_host}: the roll did not start: {failure}")
            for hp in live:
                self.outcome(hp.host).status = HostStatus.NOT_STARTED
            self.roll_summary(roll, "the roll did not start")
            return
        if roll.adopted:
            self.report.summary.append(
                f"{', '.join(roll.adopted)}: already on vLLM {roll.new_vllm} (their engines said so; a stopped roll had not recorded it)"
            )
        previous = roll.prepare
        for index, step in enumerate(roll.steps, 1):
            hosts = [by_host[h] for h in step.step.nodes if h in by_host]
            label = f"cohort step {index}/{len(roll.steps)} ({step.step.kind.value}: {', '.join(step.step.nodes)})"
            self.progress(router_host, f"{label}: starting")
            started = time.monotonic()
            self.in_roll_step = True
            try:
                failed = self.run_roll_step(step, hosts)
            finally:
                self.in_roll_step = False
            if failed is not None:
                culprit, why = failed
                forward = self.only_new_serves(roll, step)
                if forward:
                    message = f"{label}: {why}; paused, not rolled back: {forward}; fix the cause and run apply again (it resumes)"
                    self.progress(router_host, message)
                    for hp in hosts:
                        out = self.outcome(hp.host)
                        if out.status is not HostStatus.DIRTY:
                            out.status, out.message = HostStatus.PAUSED, message
                    self.report.summary.append(f"{label}: paused ({why})")
                else:
                    self.progress(router_host, f"{label}: failed ({why}); rolling this step back, the roll stops here")
                    back = self.router_stage(previous)
                    if back:
                        self.report.problems.append(f"{previous.host}: router config of the step before not restored: {back}")
                    if hosts:
                        self.fail_generation(hosts, culprit or hosts[0], f"{label}: {why}")
                    self.report.summary.append(f"{label}: failed and rolled back ({why})")
                for later in roll.steps[index:]:
                    for name in later.step.nodes:
                        if name in by_host and self.outcome(name).status is HostStatus.UNCHANGED:
                            out = self.outcome(name)
                            out.status = HostStatus.NOT_STARTED
                            out.message = f"not changed: the roll stopped at {label}"
                for hp in live:
                    if hp.host not in in_roll and self.outcome(hp.host).status is HostStatus.UNCHANGED:
                        self.outcome(hp.host).status = HostStatus.NOT_STARTED
                        self.outcome(hp.host).message = f"not changed: the roll stopped at {label}"
                self.roll_summary(roll, f"the roll stopped at step {index} of {len(roll.steps)}")
                return
            took = time.monotonic() - started
            self.progress(router_host, f"{label}: done in {took:.1f} s")
            self.report.summary.append(f"{label}: done in {took:.0f} s")
            previous = step.router
        self._run_waves([hp for hp in live if hp.host not in in_roll])
        if self.report.exit_code == 0:
            self.measure_links(live)  # a new release: P's seed is re-measured inside the new generation
        self.roll_summary(roll, f"the roll finished: every node on vLLM {roll.new_vllm}" if self.report.exit_code == 0 else "")

    def only_new_serves(self, roll: Any, step: Any) -> str:
        """Why a failed step must not be rolled back — the new generation serves and, without this step's nodes, no
        generation would (rolling back the only generation that serves is an outage) — or "" (roll back)."""
        serving, listing, failure = self.router_serving(step.gate.host, step.gate.admin_base, step.gate.key_file)
        if failure:
            return ""
        new, old = serving.get(roll.new, {}), serving.get(roll.old, {})
        own = {"prefill": 0, "decode": 0}
        names = {name for _, name in step.gate.member_roles()}
        for u in listing:
            if u.get("name") in names and u.get("state") == "serving" and u.get("generation") == roll.new:
                role = str(u.get("role"))
                own[role] = own.get(role, 0) + 1
        without = {r: new.get(r, 0) - own.get(r, 0) for r in ("prefill", "decode")}
        if _complete(new) and not _complete(old) and not _complete(without):
            return f"vLLM {roll.new_vllm} ({roll.new[:12]}) is the only generation serving ({_caps_text(serving)})"
        return ""

    def roll_summary(self, roll: Any, headline: str) -> None:
        """The report's last lines: the outcome, then what the router serves per generation."""
        serving, _, failure = self.router_serving(roll.prepare.host, roll.prepare.admin_base, roll.prepare.key_file)
        names = {roll.old: f"vLLM {roll.old_vllm} ({roll.old[:12]})", roll.new: f"vLLM {roll.new_vllm} ({roll.new[:12]})"}
        if headline:
            self.report.summary.append(headline)
        if failure:
            self.report.summary.append(f"serving: unknown (the router's admin API: {failure})")
            return
        parts = [
            f"{names.get(g, g[:12])} {c['prefill']} P + {c['decode']} D" for g, c in sorted(serving.items(), key=lambda x: x[0] != roll.old)
        ]
        self.report.summary.append("serving now (the router's count): " + ("; ".join(parts) or "nothing"))

    def run_roll_step(self, step: Any, hosts: list[HostPlan]) -> tuple[HostPlan | None, str] | None:
        """One cohort step; (the host to blame or None, why) when it failed, else None."""
        parallel = self.options.parallel
        try:
            for drain in step.drains:
                self.drain(drain)
            if step.step.kind.value != "retire":
                for phase in (self.install, self.stop_removed, self.stage, self.commit):
                    for_each_host(hosts, self.guarded(phase), parallel)
                    bad = next((hp for hp in hosts if not self.alive(hp.host)), None)
                    if bad is not None:
                        return bad, self.outcome(bad.host).message
                names = {hp.host for hp in hosts}
                for role in ("prefill", "decode"):
                    batch = [(hp, unit) for hp, unit in self.unit_steps(role) if hp.host in names]
                    for (hp, unit), failure in zip(batch, for_each_host(batch, self._guarded_unit, parallel), strict=True):
                        if failure is not None:
                            logs = self.last_log_lines(hp, _start(unit).log_command())
                            tail = " | ".join(line for line in logs.splitlines()[-5:] if line.strip())
                            return hp, failure + (f"; last log lines: {tail}" if tail else "")
                for probe_op in step.probes:
                    failure = self.probe_pull(probe_op)
                    if failure is not None:
                        return next(
                            (hp for hp in hosts if hp.host == probe_op.d_host), None
                        ), f"probe pull {probe_op.prefill}→{probe_op.decode}: {failure}"
                    self.progress(probe_op.p_host, f"probe pull {probe_op.prefill}→{probe_op.decode}: KV moved inside the new generation")
            failure = self.router_stage(step.router)
            if failure:
                return None, failure
            for undrain in step.undrains:
                self.admin(undrain, "undrain")
            for host, stop in step.stops:
                run_step(self.conns[host], stop.command(), f"systemctl stop {stop.unit}", UNIT_COMMAND_TIMEOUT)
            failure = self.serving_gate(step.gate)
            if failure:
                return None, failure
        except ConnectorError as exc:
            return next((hp for hp in hosts if hp.host == exc.host), None), exc.reason
        for_each_host([hp for hp in hosts if self.alive(hp.host)], self.guarded(self.finish), parallel)
        bad = next((hp for hp in hosts if not self.alive(hp.host)), None)
        return (bad, self.outcome(bad.host).message) if bad is not None else None

    def router_admin_config(self, host: str, base: str, key_file: str | None) -> tuple[dict[str, Any] | None, str]:
        answer = probe(self.conns[host], base, ["/admin/config"], 10.0, once=True, bearer_file=key_file)
        if answer.failure:
            return None, answer.failure
        try:
            data = json.loads(answer.body)
        except ValueError:
            return None, f"no JSON: {answer.body[:120]!r}"
        return (data, "") if isinstance(data, dict) else (None, "not an object")

    def router_stage(self, op: ops.WriteRouterConfig) -> str | None:
        """Write one step's router config (its operation's command) and wait until the router reports it loaded."""
        conn = self.conns.get(op.host)
        if conn is None:
            return f"no connection to the router node {op.host}"
        try:
            conn.put(op.content.encode(), op.path + TMP_SUFFIX)
            run_checked(conn, op.command())
        except ConnectorError as exc:
            return f"router config {op.path}: {exc.reason}"
        deadline = time.monotonic() + op.timeout
        last = ""
        while True:
            data, last = self.router_admin_config(op.host, op.admin_base, op.key_file)
            if data is not None and data.get("digest") == op.digest:
                return None
            if data is not None:
                last = f"it reports {data.get('digest')}"
            if time.monotonic() >= deadline:
                return f"the router did not load its config {op.digest} within {op.timeout:g}s ({last})"
            time.sleep(0.3)

    def router_serving(self, host: str, base: str, key_file: str | None) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]], str]:
        """The router's own view: available P and D per generation (GET /admin/config `serving`) and its upstreams
        (GET /admin/upstreams: name, role, state, generation, in_flight); with why it could not be read."""
        if host not in self.conns:
            return {}, [], f"no connection to the router node {host}"
        data, failure = self.router_admin_config(host, base, key_file)
        if data is None:
            return {}, [], failure
        serving = {
            g: {"prefill": int(c.get("prefill", 0)), "decode": int(c.get("decode", 0))}
            for g, c in (data.get("serving") or {}).items()
            if c.get("prefill") or c.get("decode")
        }
        answer = probe(self.conns[host], base, ["/admin/upstreams"], 10.0, once=True, bearer_file=key_file)
        listing: list[dict[str, Any]] = []
        if not answer.failure:
            try:
                listing = [u for u in json.loads(answer.body).get("upstreams", []) if isinstance(u, dict)]
            except (ValueError, AttributeError):
                listing = []
        return serving, listing, ""

    def serving_gate(self, op: ops.ServingGate) -> str | None:
        """The step's own instances serve in the new generation as the router reports them (op.members); a loss
        elsewhere is said (progress, the report's last lines), not failed. A plan saved before gates had members: the
        router's whole count must equal the plan's figure, as then."""
        want = op.expected()
        deadline = time.monotonic() + op.timeout
        got: dict[str, dict[str, int]] = {}
        missing: list[str] = []
        while True:
            got, listing, failure = self.router_serving(op.host, op.admin_base, op.key_file)
            if not failure:
                if not op.generation:
                    if got == want:
                        return None
                else:
                    missing = _not_serving(op, got, listing)
                    if not missing:
                        if got != want:
                            note = (
                                f"the router serves {_caps_text(got)}, the plan said {_caps_text(want)} after this step: "
                                "a loss outside the step's nodes, not undone (the roll goes on)"
                            )
                            self.progress(op.host, note)
                            self.report.summary.append(note)
                        return None
            if time.monotonic() >= deadline:
                if op.generation and not failure:
                    return (
                        f"{', '.join(missing)} not serving in {op.generation[:12]} as the router reports them "
                        f"(it serves {_caps_text(got)}) after {op.timeout:g}s"
                    )
                return f"the router serves {got or failure or 'nothing'}, the plan says {want} (after {op.timeout:g}s)"
            time.sleep(0.5)

    def _guarded_unit(self, pair: tuple[HostPlan, list[ops.Operation]]) -> str | None:
        hp, step = pair
        try:
            return self.run_unit(hp, step)
        except ConnectorError as exc:
            return exc.reason
        except Exception as exc:  # noqa: BLE001 - a bug: this unit failed; the traceback goes to the log
            log.error("%s: internal error\n%s", hp.host, traceback.format_exc())
            self.outcome(hp.host).traceback = traceback.format_exc()
            return f"internal error ({type(exc).__name__}: {exc}); traceback in the log"

    def fail_generation(self, members: list[HostPlan], failed: HostPlan, why: str) -> None:
        """A P/D generation fails as one: every member goes back to the previous files and units, together."""
        message = f"{failed.host}: {why}"
        for hp in members:
            out = self.outcome(hp.host)
            if out.status is HostStatus.DIRTY:
                continue
            out.status = HostStatus.FAILED
            out.message = message if hp is failed else f"generation rolled back because {message}"
            out.message += " (P/D generation: every member back on the previous generation)"
        self.rollback(members, message)

    def probe_pulls(self, live: list[HostPlan]) -> None:
        """EFA fleets: after every gate, the plan's probe pulls (planner.with_probe_pulls), each on a host still alive; NIXL's
        transfer counters on D must move, over LIBFABRIC (bpdkv/deploy/efa.py). A failure rolls back the host the
        operation sits on (its P/D generation) with the reason."""
        group = set(self.plan.group)
        for hp in live:
            for op in hp.operations:
                if not isinstance(op, ops.ProbePull) or not self.alive(hp.host):
                    continue
                if op.p_host not in self.conns or op.d_host not in self.conns:
                    continue
                failure = self.probe_pull(op)
                if failure is None:
                    self.progress(hp.host, f"EFA probe pull {op.prefill}→{op.decode}: KV moved over LIBFABRIC")
                    continue
                why = f"EFA probe pull {op.prefill}→{op.decode} failed: {failure}"
                if hp.host in group:
                    self.fail_generation([h for h in live if h.host in group], hp, why)
                else:
                    self.fail(hp, why)

    def measure_links(self, live: list[HostPlan]) -> None:
        """After every gate: each P measures its links and writes its seed (ops.MeasureLinks, bpdkv/deploy/linkseed.py),
        once per operation. Never fatal — a P without a seed learns its links from live pulls, as it did before — but
        never silent: the report's last lines say, per pair, the measured rate and overhead or why there is none."""
        for hp in live:
            for op in hp.operations:
                if not isinstance(op, ops.MeasureLinks) or op in self._links_measured:
                    continue
                self._links_measured.add(op)
                if not self.alive(hp.host) or op.p_host not in self.conns:
                    continue
                self.progress(hp.host, ops.describe(op))
                try:
                    result = linkseed.parse_output(self.conns[op.p_host].run(op.command, op.timeout * 3 + 30).stdout)
                except ConnectorError as exc:
                    result = exc.reason
                for line in linkseed.report_lines(op.prefill, op.decodes, result):
                    self.progress(hp.host, line)
                    self.report.summary.append(line)

    def probe_pull(self, op: ops.ProbePull) -> str | None:
        """One probe turn on P's node; D's counters and D's unit processes judged together. Why it failed, or None."""
        try:
            before, after, error = efa.parse_probe_output(self.conns[op.p_host].run(op.command, op.timeout * 3 + 30).stdout)
            if error:
                return f"the probe turn failed: {error}"
            processes = self.conns[op.d_host].run(op.processes).stdout if op.processes else ""
        except ConnectorError as exc:
            return exc.reason
        result = efa.judge_probe(before, after, processes, op.transport)
        return result.message or None


OpT = TypeVar("OpT")


def _first(hp: HostPlan, kind: type[OpT]) -> OpT | None:
    """The host's first operation of `kind` (the runner's phases pick their operations by type)."""
    return next((op for op in hp.operations if isinstance(op, kind)), None)


def _start(step: list[ops.Operation]) -> ops.StartUnit:
    return next(op for op in step if isinstance(op, ops.StartUnit))


def _caps_text(caps: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{g[:12]} {c.get('prefill', 0)} P + {c.get('decode', 0)} D" for g, c in sorted(caps.items())) or "nothing"


def _complete(caps: dict[str, int] | None) -> bool:
    return caps is not None and caps.get("prefill", 0) > 0 and caps.get("decode", 0) > 0


def _not_serving(op: ops.ServingGate, got: dict[str, dict[str, int]], listing: list[dict[str, Any]]) -> list[str]:
    """The gate's members the router does not report serving in the gate's generation (empty: the gate passes)."""
    if not op.members:
        return [] if _complete(got.get(op.generation)) else [f"a P and a D of {op.generation[:12]}"]
    states = {u.get("name"): u for u in listing}
    out = []
    for _, name in op.member_roles():
        u = states.get(name)
        if u is None or u.get("state") != "serving" or u.get("generation", op.generation) != op.generation:
            out.append(f"{name} ({'not listed' if u is None else u.get('state')})")
    if not out:
        # Listed as serving, and counted as available (the router checked the engine's release and model).
        have = got.get(op.generation, {})
        for role in ("prefill", "decode"):
            need = sum(1 for r, _ in op.member_roles() if r == role)
            if have.get(role, 0) < need:
                out.append(f"{need} {role} available (the router counts {have.get(role, 0)})")
    return out
