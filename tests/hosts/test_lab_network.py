"""The test network itself: hosts that go away and come back leave the other hosts' view of this machine unchanged."""

from __future__ import annotations

from pathlib import Path

from bpdkv.lab.hosts import BRIDGE, BRIDGE_MAC, TestHosts


def test_this_machine_keeps_its_mac_on_the_test_network_when_hosts_go_and_come_back(lab: TestHosts) -> None:
    """The bridge is this machine's side of the test network: every host's ARP entry for it holds its MAC. Unset, a
    bridge takes its lowest port's MAC, so killing hosts in turn changes it at least once (the lowest veth goes), and
    every other host then sends to a MAC nobody owns until its ARP entry ages out: CI saw SSH keepalives fail on the
    hosts a test had not touched. Each host killed and restarted in turn: the MAC stays, and SSH still answers."""
    address = Path(f"/sys/class/net/{BRIDGE}/address")
    before = address.read_text().strip()
    for host in lab.hosts:
        lab.kill_host(host)
        assert address.read_text().strip() == before, f"{host.name} went away"
        lab.restart_host(host)
        assert address.read_text().strip() == before, f"{host.name} came back"
    assert before == BRIDGE_MAC
    for host in lab.hosts:
        # The host's own ARP entry for this machine (learnt over the network, not set by the lab) names that MAC.
        poke = f"import socket\ntry:\n socket.create_connection(('{host.address.rsplit('.', 1)[0]}.1', 9), 3)\nexcept OSError:\n pass"
        neigh = lab.exec(host, f'python3 -c "{poke}"; ip neigh show dev eth0')
        assert BRIDGE_MAC in neigh.stdout, (host.name, neigh.stdout, neigh.stderr)
