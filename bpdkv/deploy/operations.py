"""Typed operations: what the runner will do on one host, as data (saved in plans, compared, shown before running).

Each operation says how it is undone (`undo`), so rollback is decided by type, never by matching reason strings.
File operations carry only the content's sha256; the runner takes the content from the render and refuses a mismatch.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Undo(str, Enum):
    RESTORE_FILE = "restore the previous file from the host's backup (or remove it if it was new)"
    RESTART_PREVIOUS = "restart the unit on its previous files"
    STOP_UNIT = "stop and disable the unit (it is new)"
    START_UNIT = "start the unit again"
    UNDRAIN = "undrain the instance on the router"
    NONE = "nothing to undo (read-only or idempotent)"
    NOT_UNDONE = "not undone: packages stay installed (idempotent; the next apply reinstalls what the plan wants)"


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
    """The node bootstrap (venv + wheels); `lines` say what changes (e.g. 'vllm 0.1 → 0.2')."""

    lines: tuple[str, ...]
    op = "install packages"
    undo = Undo.NOT_UNDONE


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
    undo = Undo.START_UNIT

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


@dataclass(frozen=True)
class HealthGate:
    """/health then /v1/models answer 200 on the node itself within `timeout` seconds."""

    unit: str
    instance: str
    address: str  # as seen from the node itself
    port: int
    timeout: float
    efa_check: bool = False
    op = "gate"
    undo = Undo.NONE


@dataclass(frozen=True)
class Drain:
    """Ask the router (on `router_host`) to stop sending new requests to `instance` and wait until in-flight ones end."""

    instance: str
    router_host: str
    router_port: int
    op = "drain"
    undo = Undo.UNDRAIN


@dataclass(frozen=True)
class Undrain:
    instance: str
    router_host: str
    router_port: int
    op = "undrain"
    undo = Undo.NONE


@dataclass(frozen=True)
class RunCommand:
    """A command run after the files are in place (destroy's clean-up); `description` is what the plan shows."""

    command: str
    description: str
    op = "run"
    undo = Undo.NONE


@dataclass(frozen=True)
class WriteManifest:
    generation: str
    sha256: str
    op = "manifest"
    undo = Undo.NONE


Operation = (
    InstallSystemPackages
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
    )
}
_BY_NAME[WriteManifest.op] = WriteManifest
_BY_NAME[RunCommand.op] = RunCommand


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
        return f"gate {op.unit}: {op.address}:{op.port} /health, /v1/models within {op.timeout:g}s" + (
            " + EFA log check" if op.efa_check else ""
        )
    if isinstance(op, Drain):
        return f"drain {op.instance} on the router ({op.router_host}:{op.router_port})"
    if isinstance(op, Undrain):
        return f"undrain {op.instance} on the router ({op.router_host}:{op.router_port})"
    if isinstance(op, RunCommand):
        return op.description
    return f"write manifest (generation {op.generation})"
