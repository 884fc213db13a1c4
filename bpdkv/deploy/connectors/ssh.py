"""SSH connector: fabric/paramiko with strict host-key checking, `jump_host` (a bastion) or `proxy_command` per node."""

from __future__ import annotations

import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
from fabric import Connection

from bpdkv.deploy.connectors import CommandResult, ConnectorError, plain_errno
from bpdkv.topology.model import Node, SshSpec

COMMAND_TIMEOUT = 120.0


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
        # fabric runs a string gateway as a ProxyCommand (%h/%p expanded like OpenSSH).
        return node.ssh.proxy_command.replace("%h", node.host).replace("%p", str(node.ssh.port)).replace("%r", node.ssh.user)
    if node.ssh.jump_host:
        jump_user, _, rest = node.ssh.jump_host.rpartition("@")
        jump_host, _, jump_port = rest.partition(":")
        jump_spec = SshSpec(
            jump_user or node.ssh.user, int(jump_port or 22), node.ssh.identity_file, node.ssh.known_hosts, None, node.ssh.connect_timeout
        )
        return _connection(jump_host, jump_spec, options)
    return None


class SshConnector:
    def __init__(self, node: Node, options: SshOptions) -> None:
        self.host = node.name
        self.node = node
        self.options = options
        self.conn = _connection(node.host, node.ssh, options, _gateway(node, options))
        self._open()

    def _open(self) -> None:
        node = self.node
        where = f"{node.ssh.user}@{node.host}:{node.ssh.port}" + (f" via {node.ssh.jump_host}" if node.ssh.jump_host else "")
        try:
            self.conn.open()
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
        try:
            result = self.conn.run(command, hide=True, warn=True, in_stream=False, timeout=timeout or self.options.command_timeout)
        except Exception as exc:  # noqa: BLE001 - invoke/paramiko raise many types; every one is a transport failure here
            name = type(exc).__name__
            raise ConnectorError(self.host, f"command failed ({name}): {str(exc).splitlines()[0] if str(exc) else name}") from None
        return CommandResult(result.exited, result.stdout, result.stderr)

    def put(self, data: bytes, path: str) -> None:
        try:
            self.conn.put(io.BytesIO(data), remote=path)
        except Exception as exc:  # noqa: BLE001 - paramiko/sftp raise many kinds; one line about this host
            raise ConnectorError(self.host, f"upload of {path} failed: {self._why(path, exc)}") from None

    def _why(self, path: str, exc: Exception) -> str:
        """SFTP answers only 'Failure': ask the shell for errno text with the same write."""
        text = str(exc) or type(exc).__name__
        if isinstance(exc, OSError | paramiko.SSHException) and text.strip() in ("Failure", "[Errno None] Failure"):
            try:
                said = self.conn.run(f"touch {shlex.quote(path)}", hide=True, warn=True, in_stream=False, timeout=30)
                if said.exited != 0 and said.stderr.strip():
                    return plain_errno(said.stderr.strip().splitlines()[-1])
            except Exception:  # noqa: BLE001 - only a better message was wanted; keep SFTP's own
                pass
        return plain_errno(text)

    def get(self, path: str) -> bytes:
        buffer = io.BytesIO()
        try:
            self.conn.get(path, local=buffer)
        except Exception as exc:  # noqa: BLE001
            raise ConnectorError(self.host, f"download of {path} failed: {plain_errno(str(exc))}") from None
        return buffer.getvalue()

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a dead transport must not mask the outcome
            pass
