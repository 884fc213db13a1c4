"""Test-server ports: outside the kernel's ephemeral range (outgoing connections cannot take them), never twice."""

from __future__ import annotations

import socket

import pytest

from bpdkv.lab import ports


def test_ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports.LOWEST <= p < low for p in got)
    for p in got[:20]:  # free for TCP and UDP (the read fence listens on UDP at the side-channel port)
        assert ports._is_free(p)


def test_a_port_in_use_for_udp_only_is_not_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        assert not ports._is_free(udp.getsockname()[1])


def test_a_port_taken_by_another_socket_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two candidate ports only; the first one is bound by someone else: the other one comes back, then none is left.
    base = ports.free_port()
    monkeypatch.setattr(ports, "LOWEST", base + 1)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: base + 3)
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.random, "randrange", lambda n: 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        if not ports._is_free(base + 2):
            pytest.skip(f"port {base + 2} is in use on this machine")
        assert ports.free_port() == base + 2
        with pytest.raises(RuntimeError, match="no free loopback port"):
            ports.free_port()
