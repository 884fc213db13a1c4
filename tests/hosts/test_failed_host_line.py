"""Issue 42 item 3 on three real SSH hosts: a proxy_command that fails for two of them (exit 1, nothing on its stderr)
is exactly one line per failed host — in `plan` the only line naming the host, in `apply` the only error line (its
summary table keeps a row per host)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bpdkv.lab.hosts import TestHosts
from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts

DENY = r"""
import runpy, sys
if sys.argv[1] in sys.argv[3].split(","):
    sys.exit(1)  # as a proxy that dies without a word
sys.argv[3] = "none"
runpy.run_path(sys.argv.pop(4), run_name="relay")
"""


def failing_proxy_topology(hosts: TestHosts, tmp_path: Path) -> Path:
    from tests.hosts.test_faults_round3 import RELAY as relay_source

    relay = tmp_path / "relay.py"
    relay.write_text(relay_source)
    deny = tmp_path / "deny.py"
    deny.write_text(DENY)
    doc = topology_doc(hosts)
    doc["ssh"]["proxy_command"] = f"{sys.executable} {deny} %h %p 10.213.0.12,10.213.0.13 {relay}"
    return write_topology(tmp_path / "t.yaml", doc)


def lines_naming(text: str, host: str, address: str) -> list[str]:
    return [line for line in text.splitlines() if host in line or address in line]


def test_plan_prints_one_line_per_failed_host(hosts: TestHosts, tmp_path: Path) -> None:
    result = bpdkv("plan", str(failing_proxy_topology(hosts, tmp_path)))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    both = result.stdout + result.stderr
    for host, address in (("host2", "10.213.0.12"), ("host3", "10.213.0.13")):
        expected = f"{host}: reachable: unreachable: root@{address}:22: proxy_command exited 1 (nothing on its stderr)"
        assert lines_naming(both, host, address) == [expected], both
    assert "host1 (10.213.0.11)\n  + /etc/bpdkv/prefill-0.env" in result.stdout, result.stdout


def test_apply_prints_one_error_line_per_failed_host(hosts: TestHosts, tmp_path: Path) -> None:
    result = bpdkv("apply", str(failing_proxy_topology(hosts, tmp_path)), "-y")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    both = result.stdout + result.stderr
    for host, address in (("host2", "10.213.0.12"), ("host3", "10.213.0.13")):
        assert [line for line in both.splitlines() if address in line] == [
            f"{host}: reachable: unreachable: root@{address}:22: proxy_command exited 1 (nothing on its stderr)"
        ], both
    assert "not started" in result.stdout  # the summary table keeps a row per host
