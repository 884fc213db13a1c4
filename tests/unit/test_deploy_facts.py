"""Fact parsers on outputs captured for real (tests/data/facts/*.txt), batching, and the import boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bpdkv.deploy.facts import DiskFree, ListeningPorts, MemlockLimit, UnitStates, batch_command, split_batch
from tests.conftest import DATA

FACTS = DATA / "facts"


def test_df_parser_on_captured_output() -> None:
    spaces = DiskFree(["/etc/bpdkv/sub", "/var/lib/bpdkv"]).parse((FACTS / "disk-rw.txt").read_text())
    assert [(s.path, s.read_only) for s in spaces] == [("/etc/bpdkv/sub", False), ("/var/lib/bpdkv", False)]
    assert spaces[0].free_bytes == 78470684 * 1024


def test_df_parser_not_writable() -> None:
    [space] = DiskFree(["/sys/fs/bpdkv"]).parse((FACTS / "disk-not-writable.txt").read_text())
    assert space.read_only and space.free_bytes == 0


def test_ss_parser_on_captured_output() -> None:
    listeners = ListeningPorts().parse((FACTS / "ports.txt").read_text())
    by_port = {entry.port: entry for entry in listeners}
    assert by_port[2024].process == "" and by_port[2024].pid is None
    assert by_port[33955].process == "python" and by_port[33955].pid == 27893 and by_port[33955].address == "127.0.0.1"


def test_ss_parser_ipv6() -> None:
    [entry] = ListeningPorts().parse('LISTEN 0 128 [::]:22 [::]:* users:(("sshd",pid=9,fd=4))\n')
    assert (entry.port, entry.address, entry.process, entry.pid) == (22, "::", "sshd", 9)


def test_ulimit_parser() -> None:
    assert MemlockLimit().parse((FACTS / "ulimit-number.txt").read_text()) == 8192
    assert MemlockLimit().parse("unlimited\n") is None
    with pytest.raises(ValueError, match="expected a number"):
        MemlockLimit().parse("sh: ulimit: bad option\n")


def test_systemctl_is_active_parser() -> None:
    # docker-systemctl-replacement (the test hosts' systemctl) prints one state per unit, in order; errors go to stderr.
    text = (FACTS / "systemctl.txt").read_text()
    states = UnitStates(["bpdkv-prefill-0.service", "bpdkv-gone.service"]).parse(text)
    assert states == {"bpdkv-prefill-0.service": "inactive", "bpdkv-gone.service": "inactive"}
    assert UnitStates(["a.service", "b.service"]).parse("active\nfailed\n") == {"a.service": "active", "b.service": "failed"}
    assert UnitStates(["a.service"]).parse("") == {"a.service": "unknown"}


def test_batch_runs_every_fact_even_when_one_fails() -> None:
    facts = [MemlockLimit(), UnitStates(["x.service"]), ListeningPorts()]
    command = batch_command([MemlockLimit(), DiskFree(["/nonexistent/dir"])]).replace("ulimit -l", "exit 3")
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30).stdout
    first, second = split_batch(out, 2)
    assert first == "" and DiskFree(["/nonexistent/dir"]).parse(second)[0].path == "/nonexistent/dir"
    assert len(split_batch("", len(facts))) == 3


def test_planner_and_facts_import_no_ssh_library() -> None:
    code = (
        "import sys, bpdkv.deploy.facts, bpdkv.deploy.planner, bpdkv.deploy.operations;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fabric', 'paramiko', 'invoke'));"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == ""


def test_dpkg_query_parser_on_captured_output() -> None:
    from bpdkv.deploy.facts import DebPackages

    fact = DebPackages(["openssh-server", "redis-server", "bpdkv-no-such-package"])
    assert fact.parse((FACTS / "dpkg-query.txt").read_text()) == {
        "openssh-server": True,
        "redis-server": True,
        "bpdkv-no-such-package": False,
    }
    assert DebPackages([]).command == "true"  # never list every package


def test_missing_debian_package_is_planned_once_installed_is_not() -> None:
    from bpdkv.deploy.facts import HostFacts
    from bpdkv.deploy.operations import InstallSystemPackages
    from bpdkv.deploy.planner import make_plan
    from bpdkv.render import render_topology
    from bpdkv.topology.validate import load_topology
    from tests.conftest import ROOT

    topology = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
    arts = render_topology(topology)
    wanted = {"host3": ("redis-server",)}
    missing = {n.name: HostFacts(n.name, True) for n in topology.nodes}
    plan = make_plan(topology, arts, missing, system_packages=wanted)
    host3 = next(h for h in plan.hosts if h.host == "host3")
    assert host3.operations[1] == InstallSystemPackages(("redis-server",))  # first after the lock
    present = {n.name: HostFacts(n.name, True, debian={"redis-server": True}) for n in topology.nodes}
    plan = make_plan(topology, arts, present, system_packages=wanted)
    assert not any(isinstance(op, InstallSystemPackages) for h in plan.hosts for op in h.operations)
