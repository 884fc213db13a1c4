"""SSH connector: fabric/paramiko with strict host-key checking, `jump_host` (a bastion) or `proxy_command` per node."""

from __future__ import annotations

import io
import logging
import os
import posixpath
import re
import select
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paramiko
from fabric import Connection

from bpdkv.deploy.connectors import CommandResult, ConnectorError, plain_errno
from bpdkv.errors import one_line
from bpdkv.topology.model import Node, SshSpec

COMMAND_TIMEOUT = 120.0
LIVENESS_TIMEOUT = 15.0  # seconds a host may take to answer an SSH keepalive (at most --command-timeout)
T = TypeVar("T")
log = logging.getLogger("bpdkv.deploy")

# paramiko's transport threads log every failed connection at ERROR with its traceback (twice per host through a failing
# ProxyCommand). The connector reports each failure itself, one line naming the host and the cause, so paramiko's own
# records are held back, unless whoever runs bpdkv configured the paramiko logger (its level is then no longer NOTSET).
_paramiko_log = logging.getLogger("paramiko")
if _paramiko_log.level == logging.NOTSET:
    _paramiko_log.setLevel(logging.CRITICAL)
STDERR_KEPT = 4096  # bytes of a proxy command's stderr kept for the message (the last ones)


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


class _Proxy(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, plus what a failing one said: its exit status and the last lines of its stderr.

    paramiko's own never reads the command's stderr (a chatty proxy would block on a full pipe) and, once the command
    has exited, spins on its closed stdout until the banner timeout ("Error reading SSH protocol banner", no cause).
    Here stderr is drained by a thread (the last STDERR_KEPT bytes kept) and the end of stdout fails the read at once."""

    def __init__(self, command_line: str) -> None:  # noqa: D107 - paramiko's constructor, with stderr kept
        self.cmd = shlex.split(command_line)
        self.timeout: float | None = None
        self.ended_by_us = False
        self._stderr: deque[bytes] = deque()
        self._stderr_size = 0
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        self._reader = threading.Thread(target=self._drain, name=f"proxy {self.cmd[0]}: stderr", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        while chunk := stream.read(1024):
            self._stderr.append(chunk)
            self._stderr_size += len(chunk)
            while self._stderr_size - len(self._stderr[0]) >= STDERR_KEPT:
                self._stderr_size -= len(self._stderr.popleft())

    def _failed(self, why: str) -> paramiko.ProxyCommandFailure:
        """Its pipes broke: the command is ending. Wait a moment for its exit status (the cause the user reads)."""
        try:
            self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        return paramiko.ProxyCommandFailure(" ".join(self.cmd), why)

    def send(self, content: bytes) -> int:
        try:
            assert self.process.stdin is not None
            sent = self.process.stdin.write(content)  # unbuffered: may be short; paramiko's write_all sends the rest
        except OSError as exc:
            raise self._failed(exc.strerror or str(exc)) from None
        return len(content) if sent is None else sent

    def recv(self, size: int) -> bytes:
        stdout = self.process.stdout
        assert stdout is not None
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([stdout], [], [], wait)
                if ready:
                    data = os.read(stdout.fileno(), size)
                    if not data:  # the command closed its stdout: it ended (or is ending); say so now
                        raise self._failed("its output ended")
                    return data
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError()
        except (TimeoutError, paramiko.ProxyCommandFailure):
            raise
        except OSError as exc:
            raise self._failed(exc.strerror or str(exc)) from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.ended_by_us = True
            try:
                self.process.send_signal(signal.SIGTERM)
            except OSError:
                pass
        threading.Thread(target=_reap, args=(self.process,), name="proxy: reap", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self.process.poll() is not None

    def said(self) -> str:
        """The last (at most two) non-empty lines of its stderr, one line; empty when it printed nothing."""
        self._reader.join(0.5)
        text = b"".join(self._stderr).decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return one_line("; ".join(lines[-2:]))[-400:]

    def outcome(self, wait: float) -> str | None:
        """How the command ended, in words ('proxy_command exited 255: denied'), waiting up to `wait` seconds for it;
        None while it still runs (or when bpdkv itself ended it)."""
        try:
            code = self.process.wait(wait)
        except subprocess.TimeoutExpired:
            return None
        if self.ended_by_us and code == -signal.SIGTERM:
            return None
        said = self.said()
        how = f"exited {code}" if code >= 0 else f"was killed by signal {-code}"
        return f"proxy_command {how}: {said}" if said else f"proxy_command {how} (nothing on its stderr)"


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class _ProxyNotStarted(Exception):
    """The proxy command could not be started at all."""


class _JumpFailed(Exception):
    """The jump host itself failed (its connect, or its forwarding to the node): `cause` is what it raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Connection(Connection):
    """fabric's Connection, keeping the ProxyCommand it starts (to report how it ended) and telling a jump host's own
    failures apart from the node's."""

    proxy: _Proxy | None = None

    def open_gateway(self) -> Any:
        if isinstance(self.gateway, str):
            # As fabric does it (a dummy ssh_config expands what proxy_command() left: '~'), with our ProxyCommand.
            config = paramiko.SSHConfig()
            config.parse(io.StringIO(f"Host {self.host}\n    ProxyCommand {self.gateway}"))
            command = config.lookup(self.host)["proxycommand"]
            try:
                self.proxy = _Proxy(command)
            except (OSError, ValueError) as exc:  # not found, not executable, unbalanced quotes
                program = (command.split() or ["?"])[0]
                said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise _ProxyNotStarted(f"proxy_command could not start: {program}: {said}") from None
            return self.proxy
        try:
            return super().open_gateway()
        except Exception as exc:  # noqa: BLE001 - classified by SshConnector._open, as the jump host's failure
            raise _JumpFailed(exc) from None


def _connection(host: str, ssh: SshSpec, options: SshOptions, gateway: Connection | str | None = None) -> Connection:
    connect_kwargs: dict[str, Any] = {
        "look_for_keys": ssh.identity_file is None,
        "allow_agent": ssh.identity_file is None,
        "banner_timeout": ssh.connect_timeout,
        "auth_timeout": ssh.connect_timeout,
    }
    if ssh.identity_file:
        connect_kwargs["key_filename"] = str(Path(ssh.identity_file).expanduser())
    conn = _Connection(
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
        where = f"{node.ssh.user}@{node.host}:{node.ssh.port}"
        try:
            conn.open()
        except Exception as exc:  # noqa: BLE001 - every way a connect fails becomes one line about this host
            proxy: _Proxy | None = getattr(conn, "proxy", None)
            if isinstance(exc, _ProxyNotStarted):
                raise ConnectorError(node.name, one_line(f"unreachable: {where}: {exc}")) from None
            if isinstance(exc, _JumpFailed):
                message = _jump_failure(exc.cause, node)
            else:
                message = _open_failure(exc, where + (f" via {node.ssh.jump_host}" if node.ssh.jump_host else ""), node)
            if proxy is not None:
                # The cause is the proxy's own: its exit status and what it printed (aws ssm start-session, ssh -W).
                ended = proxy.outcome(2.0 if isinstance(exc, paramiko.ProxyCommandFailure) else 0.2)
                said = proxy.said()
                proxy.close()
                if ended:
                    message = f"unreachable: {where}: {ended}"
                elif not _no_ssh_came(exc):
                    message += f" (proxy_command's stderr: {said})" if said else ""
                else:
                    # Still running and no SSH came through (paramiko: no banner, or "No existing session" after it
                    # stopped waiting): the proxy connected nowhere, or to something that is not sshd.
                    heard = f"; its stderr: {said}" if said else ", nothing on its stderr"
                    message = (
                        f"unreachable: {where}: no SSH answer through proxy_command within {node.ssh.connect_timeout:g}s "
                        f"(it was still running{heard}; paramiko: {_first_line(exc)})"
                    )
            raise ConnectorError(node.name, one_line(message)) from None

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
                raise ConnectorError(self.host, f"upload of {path} failed: {self._why(conn, path, exc, len(data))}") from None

        self._bounded(f"upload of {path}", call, self._transfer_timeout(len(data)))

    def _transfer_timeout(self, size: int) -> float:
        # A transfer may take its time at >= 1 MiB/s; a host that stops answering is still caught by the keepalive.
        return self.options.command_timeout + size / (1024 * 1024)

    def _why(self, conn: Connection, path: str, exc: Exception, size: int) -> str:
        """SFTP answers only 'Failure', and a write refused for lack of space can even go unanswered (paramiko then finds
        the file short: 'size mismatch in put! 0 != 351'). Ask the shell for errno text: the same write, beside it."""
        text = str(exc) or type(exc).__name__
        unclear = text.strip() in ("Failure", "[Errno None] Failure") or text.startswith("size mismatch in put")
        if isinstance(exc, OSError | paramiko.SSHException) and unclear:
            probe = shlex.quote(path + ".bpdkv-probe")
            script = f"touch {shlex.quote(path)} && head -c {size} /dev/zero > {probe}; rc=$?; rm -f {probe}; exit $rc"
            try:
                said = conn.run(script, hide=True, warn=True, in_stream=False, timeout=30)
            except Exception:  # noqa: BLE001 - only a better message was wanted; keep SFTP's own
                said = None
            if said is not None and said.exited != 0 and said.stderr.strip():
                errno_text = said.stderr.strip().splitlines()[-1]
                if "no space left on device" in errno_text.lower():
                    where = posixpath.dirname(path) or "/"
                    return f"no space left on {self.host}:{where} (a write of {size} bytes there fails: No space left on device)"
                return plain_errno(errno_text)
            if text.startswith("size mismatch in put"):
                wrote = text.split("!", 1)[-1].strip().split(" != ")[0]
                return f"the host kept {wrote} of {size} bytes of {self.host}:{path} and said no more (disk full or a quota?)"
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


def _open_failure(exc: Exception, where: str, node: Node, host: str | None = None, known_hosts: str | None = None) -> str:
    """Why a connect failed, in words; `host`/`known_hosts`: of the machine connected to (the node, or its jump host)."""
    host = host or node.host
    known_hosts = known_hosts or node.ssh.known_hosts
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed for {where} (check ssh.identity_file)"
    if isinstance(exc, paramiko.BadHostKeyException):
        return f"host key of {host} CHANGED (possible MITM); fix {known_hosts} if expected"
    if isinstance(exc, paramiko.ProxyCommandFailure):
        return f"unreachable: {where}: proxy_command failed ({exc.error})"
    if isinstance(exc, paramiko.SSHException):
        if "not found in known_hosts" in str(exc):
            # paramiko: "Server '10.0.0.5' not found in known_hosts" (the jump host's name when it is the unknown one)
            which = re.search(r"Server '\[?([^'\]]+)", str(exc))
            return f"unknown host key for {which.group(1) if which else host} (not in {known_hosts}); add it or pass --accept-new-host-keys"
        return f"SSH error for {where}: {_first_line(exc)}"
    if isinstance(exc, TimeoutError):
        return f"unreachable: {where} timed out after {node.ssh.connect_timeout:g}s"
    if isinstance(exc, OSError):
        return f"unreachable: {where}: {exc.strerror or exc}"
    if isinstance(exc, EOFError):
        return f"unreachable: {where}: the connection closed before SSH started"
    return f"connect to {where} failed ({type(exc).__name__}: {_first_line(exc)})"


def _no_ssh_came(exc: Exception) -> bool:
    """The connect failed before any SSH was heard (as opposed to an authentication or host-key refusal)."""
    if isinstance(exc, EOFError | TimeoutError | paramiko.ProxyCommandFailure):
        return True
    said = str(exc)
    return isinstance(exc, paramiko.SSHException) and any(
        words in said for words in ("protocol banner", "No existing session", "Negotiation failed", "Connection reset")
    )


def _jump_failure(exc: BaseException, node: Node) -> str:
    """The jump host failed: its own connect, or forwarding to the node (ChannelException: it could not reach it)."""
    jump = node.ssh.jump_host or "?"
    jump_user, _, rest = jump.rpartition("@")
    jump_host, _, jump_port = rest.partition(":")
    jump_where = f"{jump_user or node.ssh.user}@{jump_host}:{jump_port or 22}"
    if isinstance(exc, paramiko.ChannelException):
        return f"unreachable: jump host {jump_where} could not connect to {node.host}:{node.ssh.port} ({exc.text or exc.code})"
    if isinstance(exc, Exception):
        return "jump host: " + _open_failure(exc, jump_where, node, host=jump_host)
    return f"jump host {jump_where} failed ({type(exc).__name__})"


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
