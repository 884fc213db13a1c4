"""Execute a Plan: atomic file writes with backups, daemon-reload, restart waves with health gates, rollback, manifest last.

Every write goes through `Executor`; nothing here decides *what* to change (plan.py did).
"""

from __future__ import annotations

import io
import json
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric import Connection

from bpdkv.deploy import efa
from bpdkv.deploy.bootstrap import SOURCE_MARKER, check_installed, install_command, source_digest
from bpdkv.deploy.planner import HostPlan, Plan, UnitAction, manifest_for
from bpdkv.deploy.remote import MANIFEST_PATH, NODE_WHEELHOUSE, HostFacts, RemoteError, SshOptions, run
from bpdkv.render import Artifact
from bpdkv.topology.model import Node, Topology

BACKUP_DIR = "/var/lib/bpdkv/backup"
STATE_DIR = "/var/lib/bpdkv"
TMP_SUFFIX = ".bpdkv-new"
KEEP_BACKUPS = 3


@dataclass
class HostOutcome:
    host: str
    status: str = "unchanged"  # unchanged | applied | rolled back | failed | unreachable
    message: str = ""
    files_written: int = 0
    units_restarted: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PackageSource:
    """What the bootstrap pushes: a wheelhouse (offline, --no-index) or just bpdkv's own wheel (deps from the index)."""

    files: dict[str, Path]  # wheel name → local path
    bpdkv_wheel: str
    offline: bool


INSTALL_TIMEOUT = 3600.0  # seconds for one node's pip install: vLLM + torch from a wheelhouse take minutes


@dataclass(frozen=True)
class ApplyOptions:
    parallel: int = 8
    max_unavailable: int = 1
    start_timeout: float | None = None  # default: topology.vllm.start_timeout
    ssh: SshOptions = SshOptions()


Progress = Callable[[str, str], None]  # (host, message)


def stop_and_disable(unit: str) -> str:
    return f"systemctl stop {shlex.quote(unit)}; systemctl disable {shlex.quote(unit)}"


def _put_atomic(conn: Connection, node: str, art_path: str, content: str, mode: int, options: SshOptions) -> None:
    """Upload to a temp name beside the target, chmod, then rename: the target is never half-written."""
    tmp = art_path + TMP_SUFFIX
    parent = art_path.rsplit("/", 1)[0] or "/"
    run(conn, node, f"mkdir -p {shlex.quote(parent)}", options)
    try:
        conn.put(io.BytesIO(content.encode()), remote=tmp)
    except Exception as exc:  # noqa: BLE001 - paramiko/sftp raise many kinds; one line about this host
        raise RemoteError(node, f"upload of {art_path} failed: {exc}") from None
    run(conn, node, f"chmod {mode:o} {shlex.quote(tmp)} && mv -f {shlex.quote(tmp)} {shlex.quote(art_path)}", options)


def health_gate(address: str, port: int, timeout: float, probe_interval: float = 1.0) -> str | None:
    """None when /health and then /v1/models answer 200 within timeout; else what was last seen.

    Probes start at 50 ms apart and back off to probe_interval: small services pass quickly, big models are not hammered."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    last = "no answer"
    for path in ("/health", "/v1/models"):
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}:{port}{path}", timeout=min(5.0, max(timeout, 0.5))) as resp:
                    if resp.status == 200:
                        break
                    last = f"{path}: HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"{path}: HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = f"{path}: {getattr(exc, 'reason', exc)}"
            if time.monotonic() >= deadline:
                return last
            time.sleep(delay)
            delay = min(delay * 2, probe_interval)
    return None


class Executor:
    def __init__(
        self,
        topology: Topology,
        artifacts: list[Artifact],
        plan: Plan,
        conns: dict[str, Connection],
        options: ApplyOptions,
        progress: Progress | None = None,
        packages: PackageSource | None = None,
        node_facts: dict[str, HostFacts] | None = None,
    ) -> None:
        self.topology = topology
        self.artifacts = artifacts
        self.plan = plan
        self.conns = conns
        self.options = options
        self.progress = progress or (lambda host, msg: None)
        self.outcomes: dict[str, HostOutcome] = {h.host: HostOutcome(h.host) for h in plan.hosts}
        self.backups: dict[str, str] = {}
        self.packages = packages
        self.node_facts = node_facts or {}

    def node(self, hp: HostPlan) -> Node:
        return next(n for n in self.topology.nodes if n.name == hp.host)

    # ---- phases ----------------------------------------------------------------------------------------------
    def install_packages(self, hp: HostPlan) -> None:
        """Bootstrap: push missing wheels, make/upgrade the venv, install, verify imports and versions, record bpdkv."""
        if not hp.installs:
            return
        if self.packages is None:
            raise RemoteError(hp.host, "packages must be installed but no package source was prepared")
        conn = self.conns[hp.host]
        node = self.node(hp)
        facts = self.node_facts.get(hp.host)
        have = facts.wheelhouse if facts else {}
        run(conn, hp.host, f"mkdir -p {NODE_WHEELHOUSE}", self.options.ssh)
        pushed = 0
        for name, local in sorted(self.packages.files.items()):
            if have.get(name) == local.stat().st_size and name != self.packages.bpdkv_wheel:
                continue  # already there (wheel names carry versions; bpdkv's own is rebuilt under one name)
            try:
                conn.put(str(local), remote=f"{NODE_WHEELHOUSE}/{name}")
            except Exception as exc:  # noqa: BLE001 - paramiko/sftp raise many kinds; one line about this host
                raise RemoteError(hp.host, f"upload of {name} failed: {exc}") from None
            pushed += 1
        self.progress(hp.host, f"pushed {pushed} wheel(s); installing " + ", ".join(p.line for p in hp.packages if p.action != "none"))
        wheel = f"{NODE_WHEELHOUSE}/{self.packages.bpdkv_wheel}"
        command = install_command(self.topology, node, wheel, self.packages.offline)
        slow = SshOptions(self.options.ssh.accept_new_host_keys, max(self.options.ssh.command_timeout, INSTALL_TIMEOUT))
        code, out, err = run(conn, hp.host, "sh -c " + shlex.quote(command), slow, check=False)
        lines = out.strip().splitlines()
        try:
            report = json.loads(lines[-1]) if code == 0 and lines else None
        except ValueError:
            report = None
        if report is None:
            tail = (err or out).strip().splitlines()
            raise RemoteError(hp.host, f"package install failed (exit {code}): {tail[-1] if tail else 'no output'}")
        problems = check_installed(self.topology, node, report)
        if problems:
            raise RemoteError(hp.host, "installed packages do not verify: " + "; ".join(problems))
        venv = shlex.quote(self.topology.vllm.venv)
        run(conn, hp.host, f"echo {source_digest()} > {venv}/{SOURCE_MARKER}", self.options.ssh)
        self.progress(hp.host, "verified: " + ", ".join(f"{k} {v}" for k, v in sorted(report.get("versions", {}).items())))

    def write_files(self, hp: HostPlan) -> None:
        """Three round trips per host whatever the file count: back up + make folders, upload temps, rename all."""
        conn = self.conns[hp.host]
        opts = self.options.ssh
        changed = [f for f in hp.files if f.action != "none"]
        backup = f"{BACKUP_DIR}/{self.plan.generation}"
        self.backups[hp.host] = backup
        contents = {a.path: a for a in self.artifacts if a.host == hp.host}
        writes = [f for f in changed if f.action != "delete"]
        # Previous versions first, so a failed gate can put them back.
        script = [f"mkdir -p {shlex.quote(backup)}"]
        for f in changed:
            q = shlex.quote(f.path)
            script.append(
                f"if [ -e {q} ]; then mkdir -p {shlex.quote(backup + f.path.rsplit('/', 1)[0])} && cp -p {q} {shlex.quote(backup + f.path)}; "
                f"else echo {q} >> {shlex.quote(backup + '/.created')}; fi"
            )
        parents = sorted(
            {f.path.rsplit("/", 1)[0] or "/" for f in writes} | {f"{STATE_DIR}/{u.instance}" for u in hp.units if u.action != "stop"}
        )
        if parents:
            script.append("mkdir -p " + " ".join(shlex.quote(d) for d in parents))
        run(conn, hp.host, " && ".join(["true"] + [f"{{ {line}; }}" for line in script]), opts)
        for f in writes:
            art = contents[f.path]
            try:
                conn.put(io.BytesIO(art.content.encode()), remote=f.path + TMP_SUFFIX)
            except Exception as exc:  # noqa: BLE001 - paramiko/sftp raise many kinds; one line about this host
                raise RemoteError(hp.host, f"upload of {f.path} failed: {exc}") from None
        # Renames are atomic per file: a target is always the old or the new version, never a partial one.
        final = []
        for f in changed:
            q = shlex.quote(f.path)
            if f.action == "delete":
                final.append(f"rm -f {q}")
            else:
                tmp = shlex.quote(f.path + TMP_SUFFIX)
                final.append(f"chmod {contents[f.path].mode:o} {tmp} && mv -f {tmp} {q}")
        if final:
            run(conn, hp.host, " && ".join(final), opts)
        for f in changed:
            self.outcomes[hp.host].files_written += 1
            self.progress(hp.host, f"{f.symbol} {f.path}")
        units = [u.unit for u in hp.units if u.action in ("start", "restart")]
        if hp.daemon_reload:
            run(conn, hp.host, "systemctl daemon-reload >/dev/null 2>&1", opts, check=False)
        if units:
            run(conn, hp.host, "systemctl enable " + " ".join(shlex.quote(u) for u in units) + " >/dev/null 2>&1", opts, check=False)

    def stop_units(self, hp: HostPlan) -> None:
        for u in hp.units:
            if u.action == "stop":
                run(
                    self.conns[hp.host],
                    hp.host,
                    stop_and_disable(u.unit),
                    self.options.ssh,
                    check=False,
                )
                self.progress(hp.host, f"stopped {u.unit}")

    def start_unit(self, hp: HostPlan, u: UnitAction) -> str | None:
        """Start/restart one unit and gate on health; return the failure text, or None."""
        conn = self.conns[hp.host]
        verb = "restart" if u.action == "restart" else "start"
        code, out, err = run(conn, hp.host, f"systemctl {verb} {shlex.quote(u.unit)}", self.options.ssh, check=False)
        if code != 0:
            return f"systemctl {verb} exited {code}: {(err or out).strip()[-300:]}"
        self.progress(hp.host, f"{verb}ed {u.unit}; waiting for health")
        timeout = self.options.start_timeout or float(self.topology.vllm.start_timeout)
        if u.port is None:
            return None
        failure = health_gate(hp.address, u.port, timeout)
        if failure:
            return f"health gate failed after {timeout:g}s ({failure})"
        node = self.node(hp)
        if node.efa_devices > 0 and u.role in ("prefill", "decode") and self.topology.kv_transfer.backend == "LIBFABRIC":
            problem = efa.check_log(self.last_log_lines(hp, u.unit, n=3000))
            if problem:
                return f"EFA check failed: {problem}"
            self.progress(hp.host, f"{u.unit}: NIXL uses LIBFABRIC on EFA")
        self.outcomes[hp.host].units_restarted.append(u.unit)
        return None

    def last_log_lines(self, hp: HostPlan, unit: str, n: int = 15) -> str:
        cmd = (
            f"journalctl -u {shlex.quote(unit)} -n {n} --no-pager 2>/dev/null | tail -n {n}; "
            f"systemctl status {shlex.quote(unit)} 2>&1 | tail -n 5"
        )
        try:
            _, out, _ = run(self.conns[hp.host], hp.host, cmd, self.options.ssh, check=False)
        except RemoteError:
            return ""
        return out.strip()

    def rollback(self, hp: HostPlan) -> None:
        """Put the previous files back (or remove files this run created), reload, restart the old units."""
        conn = self.conns[hp.host]
        backup = self.backups.get(hp.host)
        if not backup:
            return
        script = (
            f"cd {shlex.quote(backup)} && "
            'find . -type f ! -name .created | while read -r f; do p=${f#.}; cp -p "$f" "$p"; done; '
            'if [ -f .created ]; then while read -r p; do rm -f "$p"; done < .created; fi'
        )
        run(conn, hp.host, script, self.options.ssh, check=False)
        run(conn, hp.host, "systemctl daemon-reload", self.options.ssh, check=False)
        for u in hp.units:
            if u.action in ("start", "restart"):
                if u.reason == "new instance":
                    run(
                        conn,
                        hp.host,
                        stop_and_disable(u.unit),
                        self.options.ssh,
                        check=False,
                    )
                else:
                    run(conn, hp.host, f"systemctl restart {shlex.quote(u.unit)}", self.options.ssh, check=False)
        self.progress(hp.host, "rolled back to the previous files and units")

    def write_manifest(self, hp: HostPlan) -> None:
        manifest = manifest_for(self.topology, hp.host, self.artifacts, self.plan.generation)
        _put_atomic(
            self.conns[hp.host], hp.host, MANIFEST_PATH, json.dumps(manifest, indent=2, sort_keys=True) + "\n", 0o644, self.options.ssh
        )
        keep = KEEP_BACKUPS
        run(
            self.conns[hp.host],
            hp.host,
            f'[ -d {BACKUP_DIR} ] && ls -1t {BACKUP_DIR} | tail -n +{keep + 1} | while read -r d; do rm -rf {BACKUP_DIR}/"$d"; done; true',
            self.options.ssh,
            check=False,
        )

    def fail(self, hp: HostPlan, status: str, message: str) -> None:
        out = self.outcomes[hp.host]
        out.status = status
        out.message = message


def execute(executor: Executor, for_each: Callable[[list[Any], Callable[[Any], Any]], list[Any]]) -> dict[str, HostOutcome]:
    """Phases across hosts: stops, files (parallel), then unit waves per role, manifests last."""
    plan = executor.plan
    live = [h for h in plan.hosts if h.reachable and h.host in executor.conns]
    for h in plan.hosts:
        if not h.reachable or h.host not in executor.conns:
            executor.fail(h, "unreachable", h.error or "not connected")

    def guarded(step: Callable[[HostPlan], Any]) -> Callable[[HostPlan], Any]:
        def inner(hp: HostPlan) -> Any:
            if executor.outcomes[hp.host].status in ("failed", "rolled back", "unreachable"):
                return None
            try:
                return step(hp)
            except RemoteError as exc:
                executor.fail(hp, "failed", exc.reason)
            return None

        return inner

    # Packages first: a host whose install fails keeps its old files and units (nothing half-deployed).
    for_each([h for h in live if h.installs], guarded(executor.install_packages))
    for_each([h for h in live if h.changed], guarded(executor.stop_units))
    for_each([h for h in live if h.changed], guarded(executor.write_files))

    # Waves by role; within a role at most max_unavailable units restart at once (across hosts).
    for role in ("prefill", "decode", "router"):
        todo = [(h, u) for h in live for u in h.units if u.role == role and u.action in ("start", "restart")]
        size = max(1, executor.options.max_unavailable)
        for start in range(0, len(todo), size):
            batch = [(h, u) for h, u in todo[start : start + size] if executor.outcomes[h.host].status not in ("failed", "rolled back")]
            results = for_each(batch, lambda pair: _start(executor, *pair))
            for (h, u), failure in zip(batch, results, strict=True):
                if isinstance(failure, RemoteError):
                    executor.fail(h, "failed", failure.reason)
                elif failure:
                    logs = executor.last_log_lines(h, u.unit)
                    executor.rollback(h)
                    tail = " | ".join(line for line in logs.splitlines()[-5:] if line.strip())
                    executor.fail(
                        h,
                        "rolled back",
                        f"{u.unit}: {failure}; rolled back to previous files" + (f"; last log lines: {tail}" if tail else ""),
                    )

    def finish(hp: HostPlan) -> None:
        executor.write_manifest(hp)
        out = executor.outcomes[hp.host]
        out.status = "applied" if hp.changed else "unchanged"

    for_each([h for h in live if executor.outcomes[h.host].status not in ("failed", "rolled back")], guarded(finish))
    return executor.outcomes


def _start(executor: Executor, hp: HostPlan, unit: UnitAction) -> str | RemoteError | None:
    try:
        return executor.start_unit(hp, unit)
    except RemoteError as exc:
        return exc
