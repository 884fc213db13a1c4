"""Typed operations: what the runner will do on one host, as data (saved in plans, compared, shown before running).

Each operation says how it is undone (`undo`), so rollback is decided by type, never by matching reason strings.
File operations carry only the content's sha256; the runner takes the content from the render and refuses a mismatch.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from bpdkv.deploy import efa
from bpdkv.deploy.bootstrap import SOURCE_MARKER
from bpdkv.deploy.facts import BACKUP_DIR, DIRTY_PATH, LOCK_PATH, MANIFEST_PATH, NODE_WHEELHOUSE
from bpdkv.deploy.linkseed import seed_path as linkseed_path

STATE_DIR = "/var/lib/bpdkv"
TMP_SUFFIX = ".bpdkv-new"  # a staged file beside its target, renamed into place by the commit
PART = ".bpdkv-part"  # a backup copy being written; only a verified copy is renamed to its final name
KEEP_BACKUPS = 3


class Undo(str, Enum):
    RESTORE_FILE = "restore the previous file from the host's backup (or remove it if it was new)"
    RESTART_PREVIOUS = "restart the unit on its previous files"
    STOP_UNIT = "stop and disable the unit (it is new)"
    NOT_RESTARTED = "not undone: a unit no longer in the topology stays stopped (a rollback restores its files)"
    UNDRAIN = "undrain the instance on the router"
    NONE = "nothing to undo (read-only or idempotent)"
    NOT_UNDONE = "not undone: packages stay installed (idempotent; the next apply reinstalls what the plan wants)"
    RESTORE_BACKUP = "run the restore script: every backed-up file back, every created file removed, then daemon-reload"
    UNLOCK = "released by the host's unlock operation, whatever happened"
    REMOVE_STAGED = "the staged copies are removed at the end, whatever happened"
    PREVIOUS_ROUTER_CONFIG = "the router config of the step before is written again (the router re-reads it)"


@dataclass(frozen=True)
class InstallSystemPackages:
    packages: tuple[str, ...]
    op = "install system packages"
    undo = Undo.NOT_UNDONE

    def command(self) -> str:
        names = " ".join(shlex.quote(p) for p in self.packages)
        # Idempotent: apt-get runs only when dpkg does not report every package installed.
        return (
            f"[ \"$(dpkg-query -W -f='${{Status}}\\n' {names} 2>/dev/null | grep -c '^install ok installed$')\" = {len(self.packages)} ] || "
            f"DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {names}"
        )


@dataclass(frozen=True)
class InstallPackages:
    """The node bootstrap (venv + wheels); `lines` say what changes (e.g. 'vllm 0.1 → 0.2'). The wheels are pushed to
    NODE_WHEELHOUSE, the install script (bootstrap.install_command: it names the wheel apply builds or the wheelhouse
    holds, so it is made at apply time) runs, and `source` (the bpdkv build's digest) is recorded in `venv`."""

    lines: tuple[str, ...]
    venv: str = ""
    source: str = ""
    op = "install packages"
    undo = Undo.NOT_UNDONE

    def mkdir_command(self) -> str:
        return f"mkdir -p {NODE_WHEELHOUSE}"

    def record_command(self) -> str:
        return f"echo {self.source} > {shlex.quote(self.venv)}/{SOURCE_MARKER}"


@dataclass(frozen=True)
class UploadFile:
    path: str
    mode: int
    sha256: str
    secret: bool = False
    instance: str | None = None
    reader: str | None = None  # non-root service user that reads the file: owner root, group that user's group
    op = "upload"
    undo = Undo.RESTORE_FILE


@dataclass(frozen=True)
class DeleteFile:
    path: str
    op = "delete"
    undo = Undo.RESTORE_FILE


@dataclass(frozen=True)
class DaemonReload:
    op = "daemon-reload"
    undo = Undo.NONE

    def command(self) -> str:
        return "systemctl daemon-reload >/dev/null"  # its exit status fails the host; stderr says why


@dataclass(frozen=True)
class StopUnit:
    unit: str
    instance: str
    reason: str
    op = "stop"
    undo = Undo.NOT_RESTARTED

    def command(self) -> str:
        return stop_and_disable(self.unit)


@dataclass(frozen=True)
class StartUnit:
    """Start (new or not running) or restart (running) a unit; `new` units are stopped on rollback."""

    unit: str
    instance: str
    role: str
    restart: bool
    new: bool
    reason: str
    op = "start"

    @property
    def undo(self) -> Undo:
        return Undo.STOP_UNIT if self.new else Undo.RESTART_PREVIOUS

    def command(self) -> str:
        verb = "restart" if self.restart else "start"
        return f"systemctl enable {shlex.quote(self.unit)} >/dev/null && systemctl {verb} {shlex.quote(self.unit)}"

    def undo_command(self) -> str:
        """STOP_UNIT: stopped and disabled; RESTART_PREVIOUS: restarted on the previous files (restored before)."""
        return stop_and_disable(self.unit) if self.new else f"systemctl restart {shlex.quote(self.unit)}"

    def log_command(self) -> str:
        """Read-only, when it failed: the unit's last log lines, said with the failure."""
        return unit_log_command(self.unit, 15)


@dataclass(frozen=True)
class HealthGate:
    """`paths` of `base` (/health then /v1/models; HTTPS for a TLS router, /health alone for a keyed one) answer 200 on
    the node itself within `timeout` seconds."""

    unit: str
    instance: str
    address: str  # as seen from the node itself
    port: int
    timeout: float
    efa_check: bool = False
    base: str = ""
    paths: tuple[str, ...] = ()
    op = "gate"
    undo = Undo.NONE

    def efa_commands(self) -> tuple[str, str]:
        """Read-only, when `efa_check`: the unit's log (LIBFABRIC chosen?) and what its processes mapped."""
        return unit_log_command(self.unit, 3000), efa.process_command(self.unit)


@dataclass(frozen=True)
class Drain:
    """Ask the router (on `router_host`) to stop sending new requests to `instance` and wait until in-flight ones end:
    its admin API at `admin_base` (as seen from the router's node), with the bearer key read there from `key_file`."""

    instance: str
    router_host: str
    router_port: int
    admin_base: str = ""
    key_file: str | None = None
    op = "drain"
    undo = Undo.UNDRAIN


@dataclass(frozen=True)
class Undrain:
    instance: str
    router_host: str
    router_port: int
    admin_base: str = ""
    key_file: str | None = None
    op = "undrain"
    undo = Undo.NONE


@dataclass(frozen=True)
class ProbePull:
    """EFA fleets, after every gate: one real P→D turn run on P's node (`command`), D's NIXL counters read around it and
    D's unit processes (`processes`, run on D's node) judged with it. Placed on the host it blames: D's when D restarted,
    else P's; a failure rolls that host (its P/D generation) back."""

    prefill: str
    decode: str
    p_host: str
    d_host: str
    command: str
    processes: str
    timeout: float
    transport: str = "efa"  # "efa": bytes count only over LIBFABRIC; "any": a cohort's gate (KV moved inside it)
    op = "probe pull"
    undo = Undo.NONE


@dataclass(frozen=True)
class MeasureLinks:
    """After every gate of a plan that started or restarted a P or a D: P measures its links to the decode instances
    with real NIXL pulls at realistic sizes (`command`, bpdkv/deploy/linkseed.py, run on P's node) and writes the seed
    its plugin reads (issue 45 item 3: P's first conversations are decided by the measured link, not by live probes).
    Never undone and never fatal: P without a seed learns the link from live pulls, as before; apply says which."""

    prefill: str
    p_host: str
    decodes: tuple[str, ...]
    command: str
    timeout: float
    op = "measure links"
    undo = Undo.NONE


@dataclass(frozen=True)
class WriteRouterConfig:
    """Cohort apply: the router's config as it must read after one step of the roll (both generations, each node's P
    and D in the generation it serves then), written atomically on the router's node. The router re-reads its upstreams
    and generations without a restart; the step goes on once GET /admin/config reports `digest` (sha256 of `content`,
    first 16 hex digits). Undone by writing the config of the step before again."""

    host: str
    path: str
    mode: int
    content: str
    digest: str
    admin_base: str
    key_file: str | None = None
    timeout: float = 60.0
    op = "router config"
    undo = Undo.PREVIOUS_ROUTER_CONFIG

    def command(self) -> str:
        staged, path = shlex.quote(self.path + TMP_SUFFIX), shlex.quote(self.path)
        return f"chmod {self.mode:o} {staged} && mv -f {staged} {path}"


@dataclass(frozen=True)
class ServingGate:
    """Cohort apply: the step's own instances (`members`, "role:name") must serve in `generation` as the router itself
    reports them (GET /admin/upstreams: listed in that generation, state serving; GET /admin/config `serving`: at least
    that many available per role) within `timeout` seconds. The gate judges what the step changed: a loss elsewhere (an
    engine of the old generation that died meanwhile) is reported against the plan's figure for the step (`serving`,
    JSON {generation: {prefill, decode}}), never a reason to undo a step whose own nodes serve. A step without members
    (retire) passes once `generation` has a P and a D available."""

    host: str
    admin_base: str
    serving: str
    key_file: str | None = None
    timeout: float = 120.0
    generation: str = ""
    members: tuple[str, ...] = ()
    op = "serving gate"
    undo = Undo.NONE

    def expected(self) -> dict[str, dict[str, int]]:
        data: dict[str, dict[str, int]] = json.loads(self.serving)
        return data

    def member_roles(self) -> list[tuple[str, str]]:
        return [(m.split(":", 1)[0], m.split(":", 1)[1]) for m in self.members]


@dataclass(frozen=True)
class RunCommand:
    """A command run after the files are in place (destroy's clean-up); `description` is what the plan shows."""

    command: str
    description: str
    op = "run"
    undo = Undo.NONE


@dataclass(frozen=True)
class WriteManifest:
    """Last on a host that succeeded: `content` (what the host now runs) staged beside the manifest and renamed over it,
    the dirty marker removed, only the newest KEEP_BACKUPS backup folders kept."""

    generation: str
    sha256: str
    content: str = ""
    op = "manifest"
    undo = Undo.NONE

    def mkdir_command(self) -> str:
        return f"mkdir -p {shlex.quote(MANIFEST_PATH.rsplit('/', 1)[0])}"

    def command(self) -> str:
        return (
            f"mv -f {MANIFEST_PATH}{TMP_SUFFIX} {MANIFEST_PATH} && rm -f {DIRTY_PATH} && "
            f'{{ [ -d {BACKUP_DIR} ] && ls -1t {BACKUP_DIR} | tail -n +{KEEP_BACKUPS + 1} | while read -r d; do rm -rf {BACKUP_DIR}/"$d"; done; true; }}'
        )


@dataclass(frozen=True)
class Lock:
    """Take the host's apply lock before anything is written anywhere; refused (exit 3, the holder's record printed)
    when another apply holds it. The record names the applying process (`owner`, known only when apply runs, like an
    upload's content) and when it started (the host's clock)."""

    path: str
    topology: str
    generation: str
    op = "lock"
    undo = Undo.UNLOCK

    def command(self, owner: str) -> str:
        sentinel = "@started@"
        record = json.dumps(
            {"owner": owner, "pid": owner.rsplit(" ", 1)[-1], "started": sentinel, "topology": self.topology, "generation": self.generation}
        )
        head, tail = record.split(json.dumps(sentinel))
        folder = shlex.quote(self.path.rsplit("/", 1)[0] or "/")
        path = shlex.quote(self.path)
        return (
            f'mkdir -p {folder} && ( set -C; printf \'%s"%s"%s\\n\' {shlex.quote(head)} "$(date -u +%Y-%m-%dT%H:%M:%SZ)" '
            f"{shlex.quote(tail)} > {path} ) 2>/dev/null || {{ cat {path}; exit 3; }}"
        )


@dataclass(frozen=True)
class Unlock:
    """Release the lock, only if it is still ours (a missing one, removed by --force-unlock elsewhere, is fine)."""

    path: str
    op = "unlock"
    undo = Undo.NONE

    def command(self, owner: str) -> str:
        mine = shlex.quote(f'"owner": {json.dumps(owner)}')
        path = shlex.quote(self.path)
        return f"if grep -qF {mine} {path} 2>/dev/null; then rm -f {path}; fi"


@dataclass(frozen=True)
class Stage:
    """Before the uploads: the folders of the new files and of each started unit's working directory (WorkingDirectory=
    must exist), and each secret's staged copy made empty and 0600 before its upload fills it (never readable by others,
    not even briefly). The uploads then write each file beside its target (`path` + TMP_SUFFIX)."""

    folders: tuple[str, ...]
    secret_temps: tuple[str, ...]
    op = "stage"
    undo = Undo.REMOVE_STAGED

    def commands(self) -> list[str]:
        out = []
        if self.folders:
            out.append("mkdir -p " + " ".join(shlex.quote(d) for d in self.folders))
        if self.secret_temps:
            temps = " ".join(shlex.quote(t) for t in self.secret_temps)
            out.append(f'umask 077 && for f in {temps}; do rm -f "$f" && : > "$f"; done')
        return out


@dataclass(frozen=True)
class Commit:
    """Back up, verify the staged files and rename them into place: `script`, one round trip (see commit_script), and
    the `restore` script that undoes it (see restore_function). Both are rendered by the planner, saved with the plan."""

    backup: str
    paths: tuple[str, ...]
    script: str
    restore: str
    op = "commit"
    undo = Undo.RESTORE_BACKUP


@dataclass(frozen=True)
class MarkDirty:
    """Run only when a rollback fails: the marker makes every later plan show the host and apply repair it."""

    path: str
    text: str
    op = "dirty marker"
    undo = Undo.NONE

    def command(self) -> str:
        folder = shlex.quote(self.path.rsplit("/", 1)[0] or "/")
        return f"mkdir -p {folder} && printf '%s\\n' {shlex.quote(self.text)} > {shlex.quote(self.path)}"


@dataclass(frozen=True)
class RemoveStaged:
    """Last, whatever happened: the staged copies still left (a failed upload or commit, the manifest's)."""

    paths: tuple[str, ...]
    op = "remove staged"
    undo = Undo.NONE

    def command(self) -> str:
        return "rm -f " + " ".join(shlex.quote(p) for p in self.paths)


Operation = (
    WriteRouterConfig
    | ServingGate
    | Lock
    | Unlock
    | Stage
    | Commit
    | MarkDirty
    | RemoveStaged
    | InstallSystemPackages
    | InstallPackages
    | UploadFile
    | DeleteFile
    | DaemonReload
    | StopUnit
    | StartUnit
    | HealthGate
    | Drain
    | Undrain
    | RunCommand
    | WriteManifest
    | ProbePull
    | MeasureLinks
)
_BY_NAME: dict[str, type[Any]] = {
    cls.op: cls
    for cls in (
        InstallSystemPackages,
        InstallPackages,
        UploadFile,
        DeleteFile,
        DaemonReload,
        StopUnit,
        StartUnit,
        HealthGate,
        Drain,
        Undrain,
        Lock,
        Unlock,
        Stage,
        Commit,
        MarkDirty,
        RemoveStaged,
        ProbePull,
        MeasureLinks,
    )
}
_BY_NAME[WriteManifest.op] = WriteManifest
_BY_NAME[RunCommand.op] = RunCommand
_BY_NAME[WriteRouterConfig.op] = WriteRouterConfig
_BY_NAME[ServingGate.op] = ServingGate


def unit_log_command(unit: str, n: int) -> str:
    u = shlex.quote(unit)
    return f"journalctl -u {u} -n {n} --no-pager 2>/dev/null | tail -n {n}; systemctl status {u} 2>&1 | tail -n 5"


def shell_commands(op: Operation, owner: str) -> list[str]:
    """Every shell command `op` may send to its host: its action, its undo, and what is read when it fails. The runner
    sends nothing else (tests/unit/test_deploy_runner.py records and compares); `owner` is the applying process. HTTP
    from the node (gates, the router's admin API) goes through connectors.probe with the URLs the operation holds."""
    if isinstance(op, Lock | Unlock):
        return [op.command(owner)]
    if isinstance(op, Stage):
        return op.commands()
    if isinstance(op, Commit):
        return [op.script, op.restore, DaemonReload().command()]
    if isinstance(op, StartUnit):
        return [op.command(), op.undo_command(), op.log_command()]
    if isinstance(op, HealthGate):
        return list(op.efa_commands()) if op.efa_check else []
    if isinstance(op, ProbePull):
        return [op.command, op.processes]
    if isinstance(op, MeasureLinks):
        return [op.command]
    if isinstance(op, WriteManifest):
        return [op.mkdir_command(), op.command()]
    if isinstance(op, RunCommand):
        return [op.command]
    if isinstance(op, WriteRouterConfig):
        return [op.command()]
    if isinstance(op, InstallPackages):
        return [op.mkdir_command(), op.record_command()]  # and the install script, made at apply time (see the class)
    if isinstance(op, InstallSystemPackages | DaemonReload | StopUnit | MarkDirty | RemoveStaged):
        return [op.command()]
    return []  # uploads (files put, no shell), drains and gates (HTTP from the node)


def stop_and_disable(unit: str) -> str:
    """Non-zero only when the unit is still active afterwards (a unit already gone or stopped is what was wanted)."""
    u = shlex.quote(unit)
    return (
        f"systemctl stop {u}; s=$?; systemctl disable {u} >/dev/null 2>&1; "
        f'if [ $s != 0 ] && [ "$(systemctl is-active {u} 2>/dev/null)" = active ]; then exit $s; fi; true'
    )


def to_json(op: Operation) -> dict[str, Any]:
    data = asdict(op)
    for key, value in data.items():
        if isinstance(value, tuple):
            data[key] = list(value)
    return {"op": op.op, **data}


def from_json(data: dict[str, Any]) -> Operation:
    fields = dict(data)
    cls = _BY_NAME[fields.pop("op")]
    for key, value in fields.items():
        if isinstance(value, list):
            fields[key] = tuple(value)
    op: Operation = cls(**fields)
    return op


def describe(op: Operation) -> str:
    """One line per operation, for plans and fixtures ("facts in → operations out")."""
    if isinstance(op, UploadFile):
        group = f" group of {op.reader}" if op.reader else ""
        return f"upload {op.path} mode {op.mode:o}{group} sha256 {op.sha256[:12]}" + (" (secret)" if op.secret else "")
    if isinstance(op, DeleteFile):
        return f"delete {op.path}"
    if isinstance(op, InstallSystemPackages):
        return "apt-get install " + " ".join(op.packages)
    if isinstance(op, InstallPackages):
        return "install packages: " + "; ".join(op.lines)
    if isinstance(op, DaemonReload):
        return "systemctl daemon-reload"
    if isinstance(op, StopUnit):
        return f"stop {op.unit} ({op.reason})"
    if isinstance(op, StartUnit):
        return f"{'restart' if op.restart else 'start'} {op.unit} ({op.reason})"
    if isinstance(op, HealthGate):
        return f"gate {op.unit}: {op.base or f'{op.address}:{op.port}'} {', '.join(op.paths)} within {op.timeout:g}s" + (
            " + EFA log check" if op.efa_check else ""
        )
    if isinstance(op, Drain):
        return f"drain {op.instance} on the router ({op.router_host}:{op.router_port}, admin API {op.admin_base or '?'})"
    if isinstance(op, Undrain):
        return f"undrain {op.instance} on the router ({op.router_host}:{op.router_port}, admin API {op.admin_base or '?'})"
    if isinstance(op, RunCommand):
        return op.description
    if isinstance(op, ProbePull):
        if op.transport == "any":
            return f"probe pull {op.prefill}→{op.decode}: one turn on {op.p_host}, D's NIXL counters must move (inside the new generation)"
        return f"EFA probe pull {op.prefill}→{op.decode}: one turn on {op.p_host}, KV must move over LIBFABRIC"
    if isinstance(op, MeasureLinks):
        return (
            f"measure links {op.prefill}→{', '.join(op.decodes)}: real NIXL pulls on {op.p_host}, the seed P reads "
            f"({linkseed_path(op.prefill)})"
        )
    if isinstance(op, WriteRouterConfig):
        return f"router config {op.path} on {op.host} (digest {op.digest}): the router re-reads its upstreams, no restart"
    if isinstance(op, ServingGate):
        want = ", ".join(f"{g[:12]} {c['prefill']} P + {c['decode']} D" for g, c in op.expected().items())
        if op.members:
            mine = ", ".join(name for _, name in op.member_roles())
            return (
                f"serving gate on {op.host}: {mine} serve in {op.generation[:12]} as the router reports them within "
                f"{op.timeout:g}s (the plan's figure after the step: {want or 'nothing'})"
            )
        return f"serving gate on {op.host}: the router reports {want or 'nothing'} within {op.timeout:g}s"
    if isinstance(op, Lock):
        return f"lock {op.path} (refused if another apply holds it)"
    if isinstance(op, Unlock):
        return f"unlock {op.path} (if still ours)"
    if isinstance(op, Stage):
        return "stage: mkdir " + " ".join(op.folders) + (f"; {len(op.secret_temps)} secret(s) staged 0600" if op.secret_temps else "")
    if isinstance(op, Commit):
        return f"commit {len(op.paths)} file(s): back up to {op.backup}, verify, rename into place (else restore)"
    if isinstance(op, MarkDirty):
        return f"if a rollback fails: write the dirty marker {op.path}"
    if isinstance(op, RemoveStaged):
        return f"remove the staged copies left (*{TMP_SUFFIX}, {len(op.paths)} path(s))"
    return f"write manifest (generation {op.generation}), remove the dirty marker, keep {KEEP_BACKUPS} backups"


def commit_script(backup: str, changes: Sequence[UploadFile | DeleteFile]) -> str:
    """Shell: back up, verify the staged files, rename them into place; on any failure restore everything (exit 1), and
    if the restore fails too, write the dirty marker (exit 2). One round trip; paths are quoted.

    No live file is replaced before every backup is complete: each is copied beside its final name, fsynced, compared
    with the live file, then renamed; a file that did not exist is recorded in .created first. Each staged file is
    fsynced and its sha256 checked against the plan before any rename. Renames are atomic, so whatever stops the script
    (a full disk, an I/O error, a killed session), each live file is the previous one or the new one, never a part."""
    b = shlex.quote(backup)
    temps = " ".join(shlex.quote(c.path + TMP_SUFFIX) for c in changes if isinstance(c, UploadFile))
    lines = [
        "set -u",
        f"B={b}",
        restore_function(),
        'fail() { echo "$1" >&2; if restore; then rm -f ' + temps + "; exit 1; "
        f'else mkdir -p /etc/bpdkv; echo "commit failed and restore failed: $1" > {DIRTY_PATH}; exit 2; fi; }}',
        f'err=$( {{ rm -rf "$B" && mkdir -p "$B"; }} 2>&1) || fail "cannot make backup folder {backup}: $err"',
    ]
    for c in changes:
        q = shlex.quote(c.path)
        kept, part = f'"$B"{q}', f'"$B"{shlex.quote(c.path + PART)}'
        parent = shlex.quote(c.path.rsplit("/", 1)[0] or "/")
        lines.append(
            f"if [ -e {q} ]; then "
            f'err=$( {{ mkdir -p "$B"{parent} && cp -p {q} {part} && sync {part} && cmp -s {q} {part} && mv -f {part} {kept}; }} 2>&1) '
            f'|| {{ rm -f {part}; fail "backup of {c.path}: ${{err:-the copy does not match the file}}"; }}; '
            f'else err=$( {{ printf \'%s\\n\' {q} >> "$B/.created" && grep -qxF {q} "$B/.created"; }} 2>&1) '
            f'|| fail "backup of {c.path}: cannot record it as new in {backup}: ${{err:-not written}}"; fi'
        )
    uploads = [c for c in changes if isinstance(c, UploadFile)]
    for c in uploads:
        tmp = shlex.quote(c.path + TMP_SUFFIX)
        lines.append(
            f'err=$(sync {tmp} 2>&1) || fail "{c.path}: staged copy: $err"; '
            f'[ "$(sha256sum < {tmp} | cut -c1-64)" = {c.sha256} ] '
            f'|| fail "{c.path}: the staged copy is not the planned file (sha256 differs: a full disk or an I/O error while uploading?)"'
        )
    for c in changes:
        q = shlex.quote(c.path)
        if isinstance(c, UploadFile):
            tmp = shlex.quote(c.path + TMP_SUFFIX)
            if c.reader:  # still 0600 (staged under umask 077) while its group changes
                user = shlex.quote(c.reader)
                lines.append(
                    f'g=$(id -gn {user} 2>/dev/null) || fail "{c.path}: user {c.reader} (vllm.user) does not exist on this host"; '
                    f'err=$(chown root:"$g" {tmp} 2>&1) || fail "{c.path}: $err"'
                )
            lines.append(f'err=$( {{ chmod {c.mode:o} {tmp} && mv -f {tmp} {q}; }} 2>&1) || fail "{c.path}: $err"')
        else:
            lines.append(f'err=$(rm -f {q} 2>&1) || fail "{c.path}: $err"')
    parents = " ".join(sorted({shlex.quote(c.path.rsplit("/", 1)[0] or "/") for c in changes}))
    lines.append(f'err=$(sync {parents} 2>&1) || fail "fsync of {parents}: $err"')  # the renames themselves on disk
    lines.append(f'err=$(touch "$B/.complete" 2>&1) || fail "backup folder {backup}: $err"')
    return "\n".join(lines)


def restore_function() -> str:
    """`restore`: every complete backup back by copy + fsync + compare + rename (never half-written), every created file
    removed; a partial backup copy (*.bpdkv-part) is never used: its live file was not touched yet. A file still equal
    to its backup (content, mode, owner) is left alone: never renamed, so an immutable one does not stop the restore,
    and the restore can run again after a cut-off commit. Returns non-zero when any file could not be put back."""
    return (
        'restore() { ok=0; [ -d "$B" ] || return 0; cd "$B" || return 1; '
        f"for f in $(find . -type f ! -name .created ! -name .complete ! -name '*{PART}'); do p=${{f#.}}; "
        'if [ -e "$p" ] && cmp -s "$f" "$p" && [ "$(stat -c %a:%u:%g "$f")" = "$(stat -c %a:%u:%g "$p")" ]; then continue; fi; '
        '{ cp -p "$f" "$p.bpdkv-old" && sync "$p.bpdkv-old" && cmp -s "$f" "$p.bpdkv-old" && mv -f "$p.bpdkv-old" "$p"; } '
        '|| { rm -f "$p.bpdkv-old"; echo "restore of $p failed" >&2; ok=1; }; done; '
        'if [ -f .created ]; then while read -r p; do rm -f "$p" || ok=1; done < .created; fi; cd /; return $ok; }'
    )


def restore_script(backup: str) -> str:
    return "\n".join(["set -u", f"B={shlex.quote(backup)}", restore_function(), "restore"])


def stage_operations(generation: str, topology: str, core: list[Operation]) -> list[Operation]:
    """A host's operations framed: the lock first; the staging before the uploads; the commit (with its restore) and the
    dirty marker after the file changes; the staged copies removed and the lock released last."""
    if not core:
        return []
    uploads = [op for op in core if isinstance(op, UploadFile)]
    changes = [op for op in core if isinstance(op, UploadFile | DeleteFile)]
    folders = {op.path.rsplit("/", 1)[0] or "/" for op in uploads}
    folders |= {f"{STATE_DIR}/{op.instance}" for op in core if isinstance(op, StartUnit)}
    secrets = tuple(op.path + TMP_SUFFIX for op in uploads if op.secret)
    backup = f"{BACKUP_DIR}/{generation}"
    out: list[Operation] = [Lock(LOCK_PATH, topology, generation)]
    staged = False
    for op in core:
        if not staged and not isinstance(op, InstallSystemPackages | InstallPackages | StopUnit):
            staged = True
            if folders or secrets:
                out.append(Stage(tuple(sorted(folders)), secrets))
        out.append(op)
        if changes and op is changes[-1]:
            out.append(Commit(backup, tuple(c.path for c in changes), commit_script(backup, changes), restore_script(backup)))
    out.append(MarkDirty(DIRTY_PATH, f"an apply of generation {generation} failed here and could not restore the previous files"))
    out.append(RemoveStaged(tuple(op.path + TMP_SUFFIX for op in uploads) + (MANIFEST_PATH + TMP_SUFFIX,)))
    out.append(Unlock(LOCK_PATH))
    return out
