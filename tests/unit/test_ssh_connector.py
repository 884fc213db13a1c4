"""The SSH connector without test hosts: what it substitutes into a ProxyCommand is quoted, and a server that accepts
TCP but never speaks SSH (a frozen sshd) fails the connect within its bound instead of hanging."""

from __future__ import annotations

import shlex
import socket
import threading
import time

import pytest

from bpdkv.deploy.connectors import ConnectorError
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions, proxy_command
from bpdkv.topology.model import Node, SshSpec


def _node(host: str, spec: SshSpec) -> Node:
    return Node("n", host, "10.0.0.1", None, "cpu", 0, None, 0, (), spec, (), ("nodes", 0))


def test_proxy_command_quotes_what_it_substitutes() -> None:
    spec = SshSpec("ubuntu", 22, None, "~/.ssh/known_hosts", None, 5.0, "sh -c 'exec ssh -W $0:$1 bastion' %h %p # 100%% %r")
    node = _node("i-0abc; touch /tmp/x", spec)
    command = proxy_command(node)
    # paramiko splits it shlex-style: the hostile host stays one argument, %% is a literal %
    assert shlex.split(command)[3:5] == ["i-0abc; touch /tmp/x", "22"] and command.endswith("# 100% ubuntu")


def test_a_server_that_never_speaks_ssh_fails_the_connect_within_its_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TCP is accepted (the kernel does that for a SIGSTOPped sshd) and nothing more ever comes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    spec = SshSpec("root", server.getsockname()[1], None, str(tmp_path / "known_hosts"), None, 1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectorError) as err:
            SshConnector(_node("127.0.0.1", spec), SshOptions(command_timeout=2.0))
    finally:
        stop.set()
        for conn in accepted:
            conn.close()
        server.close()
    took = time.monotonic() - started
    # Gives up by its own timeouts (connect 1 s + liveness 2 s), not by hanging on the silent server: bounded with room
    # for a loaded 2-core machine (the behaviour is "gives up", not how fast).
    assert took < 3 * (1.0 + 2.0), took
    assert err.value.host == "n"
