"""One interface to a node: run a command, put/get a file, probe an HTTP endpoint *from the node itself*.

Only `ConnectorError` is a transport failure the runner may turn into a per-host outcome; every other exception is a
bug in bpdkv and fails that host with its traceback. Nothing outside this package imports fabric or paramiko.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Protocol

from bpdkv.errors import BpdkvError

PROBE_SCRIPT = r"""
import json, ssl, sys, time, urllib.request, urllib.error
req = json.loads(sys.argv[1])
# The node probes its own services: a TLS router's certificate names its public address, not this one.
tls = ssl._create_unverified_context() if req["base"].startswith("https://") else None
headers = dict(req.get("headers", {}))
if req.get("bearer_file"):
    with open(req["bearer_file"]) as fh:
        headers["Authorization"] = "Bearer " + fh.read().strip()
deadline = time.monotonic() + req["timeout"]
delay, last = 0.05, "no answer"
for path in req["paths"]:
    while True:
        try:
            r = urllib.request.Request(req["base"] + path, method=req.get("method", "GET"), data=req.get("body", "").encode() or None,
                                       headers=headers)
            with urllib.request.urlopen(r, timeout=min(5.0, max(req["timeout"], 0.5)), context=tls) as resp:
                body = resp.read().decode(errors="replace")
                if resp.status == 200:
                    last = None
                    break
                last = f"{path}: HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last, body = f"{path}: HTTP {exc.code}", exc.read().decode(errors="replace")
            if req.get("once"):
                break
        except Exception as exc:
            last, body = f"{path}: {getattr(exc, 'reason', exc)}", ""
        if req.get("once") or time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, req["interval"])
    if last is not None:
        break
print(json.dumps({"failure": last, "body": body if last is None or req.get("once") else ""}))
"""


class ConnectorError(BpdkvError):
    """Transport-level failure on one host (unreachable, auth, host key, a command that could not run, SFTP refused)."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host
        self.reason = message


@dataclass(frozen=True)
class CommandResult:
    exited: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class ProbeResult:
    """None failure = HTTP 200 on every path within the timeout."""

    failure: str | None
    body: str = ""


class Connector(Protocol):
    host: str  # the node's name, for messages

    def run(self, command: str, timeout: float | None = None) -> CommandResult: ...

    def put(self, data: bytes, path: str) -> None: ...

    def get(self, path: str) -> bytes: ...

    def close(self) -> None: ...


def run_checked(conn: Connector, command: str, timeout: float | None = None) -> CommandResult:
    """Run; a non-zero exit is a ConnectorError naming the host and the last line of stderr, said in plain words."""
    result = conn.run(command, timeout)
    if result.exited != 0:
        err = (result.stderr or result.stdout).strip().splitlines()
        detail = err[-1] if err else f"exit {result.exited}"
        raise ConnectorError(conn.host, f"'{command.split()[0]}' exited {result.exited}: {plain_errno(detail)}")
    return result


def run_step(conn: Connector, command: str, step: str, timeout: float | None = None) -> CommandResult:
    """run_checked with the step named in words ("systemctl daemon-reload"): the host fails on a non-zero exit."""
    result = conn.run(command, timeout)
    if result.exited != 0:
        said = [line for line in (result.stderr + "\n" + result.stdout).splitlines() if line.strip()]
        detail = said[-1].strip() if said else "no output"
        raise ConnectorError(conn.host, f"{step} exited {result.exited}: {plain_errno(detail)[-300:]}")
    return result


def probe(
    conn: Connector,
    base: str,
    paths: list[str],
    timeout: float,
    interval: float = 1.0,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    once: bool = False,
    bearer_file: str | None = None,
) -> ProbeResult:
    """HTTP from the node itself (python3 on the node), so gates work behind jump hosts and in private subnets.
    `bearer_file`: a file *on the node* whose content is sent as a bearer token (the key never leaves the node)."""
    request = json.dumps(
        {
            "base": base,
            "paths": paths,
            "timeout": timeout,
            "interval": interval,
            "method": method,
            "headers": headers or {},
            "once": once,
            "bearer_file": bearer_file,
        }
    )
    command = f"python3 -c {shlex.quote(PROBE_SCRIPT)} {shlex.quote(request)}"
    result = conn.run(command, timeout + 30)
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConnectorError(
            conn.host, f"probe of {base} printed no answer (exit {result.exited}): {result.stderr.strip()[-200:]}"
        ) from None
    return ProbeResult(data["failure"], data.get("body", ""))


_ERRNO_WORDS = (
    ("Read-only file system", "read-only file system"),
    ("No space left on device", "no space left on device"),
    ("Operation not permitted", "operation not permitted (immutable file? see lsattr)"),
    ("Permission denied", "permission denied (bpdkv needs root or sudo-less write access)"),
    ("Disk quota exceeded", "disk quota exceeded"),
)


def plain_errno(text: str) -> str:
    """SFTP says only 'Failure'; shells say errno text. Either way the user reads what is wrong in plain words."""
    for needle, words in _ERRNO_WORDS:
        if needle.lower() in text.lower():
            return f"{words}: {text}" if words not in text else text
    return text
