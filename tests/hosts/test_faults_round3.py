"""Issue 35 item 2 on three real SSH hosts: a proxy_command that fails for one host (as `aws ssm start-session` does
without access) or a jump host that cannot reach its node is one line naming the host and the cause, never a
traceback; an upload into a really full folder (a tmpfs over /etc/bpdkv, filled after the plan) says no space left."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bpdkv.deploy.connectors import ConnectorError
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions
from bpdkv.deploy.fleet import apply_plan, load_fleet, lock_owner, plan_fleet
from bpdkv.deploy.runner import ApplyOptions, HostStatus
from bpdkv.lab.hosts import TestHosts
from tests.hosts.conftest import bpdkv, topology_doc, write_topology
from tests.hosts.test_faults_round2 import doc_version, managed_files, version_of

pytestmark = pytest.mark.hosts

# A ProxyCommand that relays stdin/stdout to host:port, except for one host, where it fails as the SSM plugin does.
RELAY = r"""
import socket, sys, threading
host, port, denied = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if host == denied:
    sys.stderr.write("\nAn error occurred (AccessDeniedException) when calling the StartSession operation: "
                     "User: arn:aws:iam::123456789012:user/ci is not authorized to perform: ssm:StartSession\n")
    sys.exit(255)
sock = socket.create_connection((host, port), timeout=5)
sock.settimeout(None)
def up():
    while data := sys.stdin.buffer.read1(65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := sock.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""
DENIED = (
    "An error occurred (AccessDeniedException) when calling the StartSession operation: "
    "User: arn:aws:iam::123456789012:user/ci is not authorized to perform: ssm:StartSession"
)


def test_a_proxy_command_that_fails_for_one_host_is_one_line_with_its_exit_status_and_stderr(hosts: TestHosts, tmp_path: Path) -> None:
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    doc = topology_doc(hosts)
    doc["ssh"]["proxy_command"] = f"{sys.executable} {relay} %h %p 10.213.0.12"
    topo = write_topology(tmp_path / "t.yaml", doc)
    result = bpdkv("plan", str(topo))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"host2: reachable: unreachable: root@10.213.0.12:22: proxy_command exited 255: {DENIED}"]
    # The two hosts the proxy reaches are planned as usual.
    assert "host1 (10.213.0.11)\n  + /etc/bpdkv/prefill-0.env" in result.stdout, result.stdout
    assert "host3 (10.213.0.13)\n  + /etc/bpdkv/router-0.env" in result.stdout, result.stdout


def test_a_jump_host_that_cannot_reach_its_node_is_one_line(hosts: TestHosts, tmp_path: Path) -> None:
    """host2 through host1 as a jump host, on a port where nothing listens: host1 refuses the forwarding."""
    doc = topology_doc(hosts)
    doc["nodes"][1]["ssh"] = {"jump_host": "root@10.213.0.11:22", "port": 2299}
    doc["nodes"][2]["ssh"] = {"jump_host": "root@10.213.0.99:22"}  # no such machine
    topo = write_topology(tmp_path / "t.yaml", doc)
    result = bpdkv("plan", str(topo))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "host2: reachable: unreachable: jump host root@10.213.0.11:22 could not connect to 10.213.0.12:2299 (Connect failed)"
    assert lines[1].startswith("host3: reachable: jump host: unreachable: root@10.213.0.99:22"), lines[1]


@pytest.fixture
def full_bpdkv_folder(hosts: TestHosts) -> Iterator[TestHosts]:
    """Unmounts what the test mounted over host2's /etc/bpdkv, whatever happened."""
    yield hosts
    hosts.exec(hosts.hosts[1], "umount /etc/bpdkv 2>/dev/null; true")


def test_an_upload_into_a_full_folder_says_no_space_left_there(full_bpdkv_folder: TestHosts, tmp_path: Path) -> None:
    """Plan v2 (preflight sees room), then host2's /etc/bpdkv becomes a small tmpfs holding the v1 files and a filler
    up to its last byte: the staged upload fails, and the line says where there is no space, not paramiko's
    'size mismatch in put! 0 != N'. The live files are v1 afterwards (the tmpfs only hid them)."""
    hosts = full_bpdkv_folder
    topo = write_topology(tmp_path / "t.yaml", doc_version(hosts, "v1"))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    v1 = managed_files(hosts.hosts[1])
    write_topology(topo, doc_version(hosts, "v2", unit_change=21))
    fleet = load_fleet(str(topo))
    try:
        plan = plan_fleet(fleet, False, 3, lambda node: SshConnector(node, SshOptions(command_timeout=20)), ("host2",))
        staged = next(f for h in plan.hosts for f in h.files if f.action != "none" and f.path.startswith("/etc/bpdkv/"))
        size = len(next(a for a in fleet.artifacts if a.path == staged.path and a.host == "host2").content.encode())
        fill = (
            "set -e; keep=$(mktemp -d) && cp -a /etc/bpdkv/. $keep/ && mount -t tmpfs -o size=64k tmpfs /etc/bpdkv && "
            "cp -a $keep/. /etc/bpdkv/ && rm -rf $keep && "
            "(dd if=/dev/zero of=/etc/bpdkv/filler bs=1k 2>/dev/null || true) && "
            "(head -c 4096 /dev/zero > /etc/bpdkv/filler2 2>/dev/null || true) && test -z \"$(df -Pk /etc/bpdkv | awk 'NR==2 && $4 > 0')\""
        )
        filled = hosts.exec(hosts.hosts[1], fill)
        assert filled.returncode == 0, filled.stdout + filled.stderr
        report = apply_plan(fleet, plan, ApplyOptions(parallel=3, owner=lock_owner()))
    finally:
        fleet.close()
        hosts.exec(hosts.hosts[1], "umount /etc/bpdkv")
    outcome = report.outcomes["host2"]
    assert report.exit_code == 1 and outcome.status is HostStatus.FAILED, report.to_json()
    assert outcome.message == (
        f"upload of {staged.path}.bpdkv-new failed: no space left on host2:/etc/bpdkv "
        f"(a write of {size} bytes there fails: No space left on device)"
    ), outcome.message
    assert managed_files(hosts.hosts[1]) == v1 and version_of("10.213.0.12", 8200) == "v1"


def test_the_connector_names_the_full_folder(full_bpdkv_folder: TestHosts, tmp_path: Path) -> None:
    """The connector alone, against a real sshd: SFTP into a full tmpfs."""
    hosts = full_bpdkv_folder
    host = hosts.hosts[1]
    assert hosts.exec(host, "mount -t tmpfs -o size=4k tmpfs /etc/bpdkv && head -c 4096 /dev/zero > /etc/bpdkv/filler").returncode == 0
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    node = next(n for n in load_fleet(str(topo)).validated.topology.nodes if n.name == "host2")
    conn = SshConnector(node, SshOptions(command_timeout=20))
    try:
        with pytest.raises(ConnectorError) as err:
            conn.put(b"x" * 351, "/etc/bpdkv/y.env")
        leftover = conn.run("ls /etc/bpdkv")
    finally:
        conn.close()
    assert str(err.value) == (
        "host2: upload of /etc/bpdkv/y.env failed: no space left on host2:/etc/bpdkv (a write of 351 bytes there fails: No space left on device)"
    )
    assert leftover.stdout.split() == ["filler", "y.env"]  # the probe's own file is gone; the runner removes its temps
