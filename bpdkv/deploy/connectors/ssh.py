"""SSH connector: fabric/paramiko with strict host-key checking, `jump_host` (a bastion) or `proxy_command` per node."""

from __future__ import annotations

import io
import logging
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paramiko
from fabric import Connection

from bpdkv.deploy.connectors import CommandResult, ConnectorError, plain_errno
from bpdkv.topology.model import Node, SshSpec

COMMAND_TIMEOUT = 120.0
LIVENESS_TIMEOUT = 15.0  # seconds a host may take to answer an SSH keepalive (at most --command-timeout)
T = TypeVar("T")
log = logging.getLogger("bpdkv.deploy")


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


def _connection(host: str, ssh: SshSpec, options: SshOptions, gateway: Connection | str | None = None) -> Connection:
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


def _gateway(node: Node, options: SshOptions) -> Connection | str | None:
    if node.ssh.proxy_command:
        return proxy_command(node)
    if node.ssh.jump_host:
        jump_user, _, rest = node.ssh.jump_host.rpartition("@")
        jump_host, _, jump_port = rest.partition(":")
        jump_spec = SshSpec(
            jump_user or node.ssh.user, int(jump_port or 22), node.ssh.identity_file, node.ssh.known_hosts, None, node.ssh.connect_timeout
        )
        return _connection(jump_host, jump_spec, options)
    return None


def proxy_command(node: Node) -> str:
    """The node's ProxyCommand with %h, %p, %r (and %% as a literal %) expanded like OpenSSH's, each value shell-quoted:
    paramiko splits the command shlex-style, and commands such as `sh -c '…' %h %p` hand them on to a shell. Hosts are
    validated host names already (bpdkv.topology.hostnames); the quoting holds even for a value that is not."""
    values = {"h": node.host, "p": str(node.ssh.port), "r": node.ssh.user, "%": "%"}
    return re.sub(
        r"%([hpr%])", lambda m: values[m.group(1)] if m.group(1) == "%" else shlex.quote(values[m.group(1)]), node.ssh.proxy_command or ""
    )


class SshConnector:
    """Every remote step is bounded, however the host fails (frozen sshd, link down, a half-open connection).

    Each call (connect, run, put, get) runs in a worker thread that this one watches. A call ends by its timeout
    (`--command-timeout` unless the step names a longer one), and a call still running after `command_timeout` has its
    host asked to prove it is alive (an SSH keepalive round trip, `liveness` seconds at most). A host that does not
    answer is abandoned at once: the transport is closed, which wakes the worker, and the call fails naming the host.
    The next call reconnects once (`ssh.connect_timeout`); if that fails too, every later call on this host fails at
    once ("stopped answering earlier"), so rollback, dirty marker and lock release cost nothing more. Bound, from the
    moment a host stops answering until the runner has given up on it: command_timeout + liveness + connect_timeout
    (at most 3 x --command-timeout while connect_timeout <= --command-timeout); docs/deploy.md.
    """

    def __init__(self, node: Node, options: SshOptions) -> None:
        self.host = node.name
        self.node = node
        self.options = options
        self.liveness = min(options.command_timeout, LIVENESS_TIMEOUT)
        self.down: str | None = None  # why this host was given up on; every later call fails at once
        self.reconnect_due = False  # a call was abandoned: the next one opens a new connection first
        self.reconnected = False  # one reconnect per run: a host that fails twice is down
        self._state = threading.Lock()
        self._keepalive = threading.Lock()
        self.conn = self._new_connection()
        self._bounded("connect", self._open, node.ssh.connect_timeout + self.liveness, opening=True)

    def _new_connection(self) -> Connection:
        return _connection(self.node.host, self.node.ssh, self.options, _gateway(self.node, self.options))

    # ---- the watchdog ----------------------------------------------------------------------------------------------
    def _bounded(self, what: str, fn: Callable[[Connection], T], timeout: float, opening: bool = False) -> T:
        """fn() within `timeout` seconds, and abandoned as soon as the host stops answering; ConnectorError otherwise."""
        if not opening:
            self._ready(what)
        conn = self.conn
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["value"] = fn(conn)
            except BaseException as exc:  # noqa: BLE001 - handed to the watching thread, which decides
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=work, name=f"ssh {self.host}: {what}", daemon=True).start()
        started = time.monotonic()
        deadline = started + timeout
        while not done.wait(max(0.0, min(deadline, time.monotonic() + self.options.command_timeout) - time.monotonic())):
            now = time.monotonic()
            if now >= deadline:
                self._abandon(conn, f"{what} did not finish within {timeout:g}s")
                raise ConnectorError(self.host, f"no answer: {what} did not finish within {timeout:g}s (host frozen or its link down?)")
            if not opening and not self._alive(conn):
                waited = now - started + self.liveness
                self._abandon(conn, f"no keepalive answer during {what}")
                raise ConnectorError(
                    self.host, f"stopped answering: no SSH keepalive answer within {self.liveness:g}s, {waited:.0f}s into {what}"
                )
        if "error" in box:
            error = box["error"]
            if not opening and not self._alive(conn):  # e.g. invoke's own timeout on a host that stopped answering
                self._abandon(conn, f"no keepalive answer after {what} failed")
                said = error.reason if isinstance(error, ConnectorError) else _first_line(error)
                raise ConnectorError(self.host, f"stopped answering: {what} failed ({said}); no SSH keepalive answer followed")
            raise error
        return box["value"]  # type: ignore[no-any-return]

    def _ready(self, what: str) -> None:
        """Before a call: fail at once on a host given up on; reconnect (once per run) after an abandoned call."""
        with self._state:
            if self.down is not None:
                raise ConnectorError(self.host, f"{what}: not tried, the host stopped answering earlier ({self.down})")
            if not self.reconnect_due:
                return
            self.reconnect_due = False
            if self.reconnected:
                self.down = "it stopped answering again after a reconnect"
                raise ConnectorError(self.host, f"{what}: not tried, {self.down}")
            self.reconnected = True
            self.conn = self._new_connection()
        try:
            self._bounded("reconnect", self._open, self.node.ssh.connect_timeout, opening=True)
        except ConnectorError as exc:
            with self._state:
                self.down = f"reconnect failed: {exc.reason}"
            raise ConnectorError(self.host, f"{what}: not tried, the host stopped answering ({self.down})") from None

    def _alive(self, conn: Connection) -> bool:
        """One SSH keepalive round trip within `liveness` seconds (any answer, even 'request failed', proves it)."""
        transport = conn.client.get_transport()
        if transport is None or not transport.is_active():
            return False
        with self._keepalive:  # paramiko keeps one pending global request per transport
            answered = threading.Event()

            def ask() -> None:
                try:
                    transport.global_request("keepalive@openssh.com", wait=True)
                except Exception:  # noqa: BLE001 - a dead transport: not answered
                    return
                answered.set()

            threading.Thread(target=ask, name=f"ssh {self.host}: keepalive", daemon=True).start()
            return answered.wait(self.liveness) and transport.is_active()

    def _abandon(self, conn: Connection, why: str) -> None:
        """Close the transport under the stuck call (that wakes it) without waiting on the host; reconnect next time."""
        log.warning("%s: abandoning the SSH connection: %s", self.host, why)
        with self._state:
            self.reconnect_due = True
        threading.Thread(target=_close_quietly, args=(conn,), name=f"ssh {self.host}: close", daemon=True).start()

    # ---- the calls -------------------------------------------------------------------------------------------------
    def _open(self, conn: Connection) -> None:
        node = self.node
        where = f"{node.ssh.user}@{node.host}:{node.ssh.port}" + (f" via {node.ssh.jump_host}" if node.ssh.jump_host else "")
        try:
            conn.open()
        except paramiko.AuthenticationException:
            raise ConnectorError(node.name, f"authentication failed for {where} (check ssh.identity_file)") from None
        except paramiko.BadHostKeyException:
            raise ConnectorError(
                node.name, f"host key of {node.host} CHANGED (possible MITM); fix {node.ssh.known_hosts} if expected"
            ) from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                # paramiko: "Server '10.0.0.5' not found in known_hosts" (the jump host's name when it is the unknown one)
                which = re.search(r"Server '\[?([^'\]]+)", str(exc))
                raise ConnectorError(
                    node.name,
                    f"unknown host key for {which.group(1) if which else node.host} "
                    f"(not in {node.ssh.known_hosts}); add it or pass --accept-new-host-keys",
                ) from None
            raise ConnectorError(node.name, f"SSH error for {where}: {exc}") from None
        except TimeoutError:
            raise ConnectorError(node.name, f"unreachable: {where} timed out after {node.ssh.connect_timeout:g}s") from None
        except OSError as exc:
            raise ConnectorError(node.name, f"unreachable: {where}: {exc.strerror or exc}") from None

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        limit = timeout or self.options.command_timeout

        def call(conn: Connection) -> CommandResult:
            try:
                result = conn.run(command, hide=True, warn=True, in_stream=False, timeout=limit)
            except Exception as exc:  # noqa: BLE001 - invoke/paramiko raise many types; every one is a transport failure here
                raise ConnectorError(self.host, f"command failed ({type(exc).__name__}): {_first_line(exc)}") from None
            return CommandResult(result.exited, result.stdout, result.stderr)

        # invoke ends the command itself at `limit` on a live host; the watchdog's margin covers a channel never opened.
        first = command.strip().splitlines()[0] if command.strip() else command
        return self._bounded(f"command '{first[:40]}{'…' if len(first) > 40 else ''}'", call, limit + self.liveness)

    def put(self, data: bytes, path: str) -> None:
        def call(conn: Connection) -> None:
            try:
                conn.put(io.BytesIO(data), remote=path)
            except Exception as exc:  # noqa: BLE001 - paramiko/sftp raise many kinds; one line about this host
                raise ConnectorError(self.host, f"upload of {path} failed: {self._why(conn, path, exc)}") from None

        self._bounded(f"upload of {path}", call, self._transfer_timeout(len(data)))

    def _transfer_timeout(self, size: int) -> float:
        # A transfer may take its time at >= 1 MiB/s; a host that stops answering is still caught by the keepalive.
        return self.options.command_timeout + size / (1024 * 1024)

    def _why(self, conn: Connection, path: str, exc: Exception) -> str:
        """SFTP answers only 'Failure': ask the shell for errno text with the same write."""
        text = str(exc) or type(exc).__name__
        if isinstance(exc, OSError | paramiko.SSHException) and text.strip() in ("Failure", "[Errno None] Failure"):
            try:
                said = conn.run(f"touch {shlex.quote(path)}", hide=True, warn=True, in_stream=False, timeout=30)
                if said.exited != 0 and said.stderr.strip():
                    return plain_errno(said.stderr.strip().splitlines()[-1])
            except Exception:  # noqa: BLE001 - only a better message was wanted; keep SFTP's own
                pass
        return plain_errno(text)

    def get(self, path: str) -> bytes:
        def call(conn: Connection) -> bytes:
            buffer = io.BytesIO()
            try:
                conn.get(path, local=buffer)
            except Exception as exc:  # noqa: BLE001
                raise ConnectorError(self.host, f"download of {path} failed: {plain_errno(str(exc))}") from None
            return buffer.getvalue()

        return self._bounded(f"download of {path}", call, self.options.command_timeout)

    def close(self) -> None:
        # Never waits on a host that stopped answering: closing is sent, not awaited.
        closer = threading.Thread(target=_close_quietly, args=(self.conn,), name=f"ssh {self.host}: close", daemon=True)
        closer.start()
        closer.join(self.liveness)


def _close_quietly(conn: Connection) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - closing a dead transport must not mask the outcome
        pass
    try:
        conn.client.close()  # fabric closes only a transport it thinks is connected
    except Exception:  # noqa: BLE001
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
