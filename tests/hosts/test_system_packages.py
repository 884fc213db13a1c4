"""System packages on real test hosts: the dpkg fact (installed or not) and `apt-get install` of what the render
needs (redis-server for a multi-worker router), offline, from a local file repository.

The hosts share this machine's /usr, so nothing real may be installed into them: each host here gets its own dpkg
database (a copy of the machine's without redis-server), its own apt configuration naming only a file repository,
and the repository holds a lab-built package *named* redis-server whose only file lands in the host's own
/opt/bpdkv. host3's repository has it; host2's is empty, so its install fails with apt's own reason
("no installation candidate": dpkg still knows the name).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bpdkv.lab.hosts import TestHosts
from tests.hosts.conftest import bpdkv, topology_doc, write_topology

if TYPE_CHECKING:
    from bpdkv.lab.hosts import TestHost

pytestmark = pytest.mark.hosts

MARKER = "/opt/bpdkv/lab-redis-server.installed"


def lab_package(where: Path) -> Path:
    """A tiny .deb called redis-server (the lab's stand-in: one marker file, no dependencies)."""
    tree = where / "pkg"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / MARKER.lstrip("/")).parent.mkdir(parents=True)
    (tree / MARKER.lstrip("/")).write_text("bpdkv lab stand-in for redis-server\n")
    (tree / "DEBIAN/control").write_text(
        "Package: redis-server\nVersion: 99:0-bpdkvlab\nArchitecture: all\nMaintainer: bpdkv tests <tests@bpdkv.invalid>\n"
        "Description: bpdkv test-host stand-in for redis-server (installs one marker file)\n"
    )
    deb = where / "redis-server_0-bpdkvlab_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)], check=True, capture_output=True)
    return deb


def packages_index(repo: Path) -> str:
    """apt's Packages index of a flat file repository: each .deb's control fields plus where it is and its checksum."""
    stanzas = []
    for deb in sorted(repo.glob("*.deb")):
        control = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout.strip()
        digest = hashlib.sha256(deb.read_bytes()).hexdigest()
        stanzas.append(f"{control}\nFilename: ./{deb.name}\nSize: {deb.stat().st_size}\nSHA256: {digest}\n")
    return "\n".join(stanzas)


def own_apt(lab: TestHosts, host: TestHost, deb: Path | None) -> None:
    """The host's own dpkg database (without redis-server), apt config, lists and cache; a file repo with `deb` or empty."""
    root = host.dir / "apt-lab"
    dpkg = root / "dpkg"
    shutil.copytree("/var/lib/dpkg", dpkg, symlinks=True)
    stanzas = (dpkg / "status").read_text().split("\n\n")
    (dpkg / "status").write_text("\n\n".join(s for s in stanzas if not s.startswith("Package: redis-server\n")))
    repo = root / "repo"
    repo.mkdir()
    if deb is not None:
        shutil.copy(deb, repo / deb.name)
    (repo / "Packages").write_text(packages_index(repo))
    etc = root / "etc-apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "apt.conf.d").mkdir()
    (etc / "preferences.d").mkdir()
    (etc / "trusted.gpg.d").mkdir()
    (etc / "sources.list").write_text(f"deb [trusted=yes] file:{repo} ./\n")
    for d in ("lists/partial", "cache/archives/partial"):
        (root / d).mkdir(parents=True)
    mounts = f"mount --bind {dpkg} /var/lib/dpkg && mount --bind {etc} /etc/apt && mount --bind {root}/lists /var/lib/apt/lists"
    mounts += f" && mount --bind {root}/cache /var/cache/apt"
    done = lab.exec(host, f"set -e; {mounts}; apt-get update -qq 2>&1; dpkg-query -W -f='${{Status}}' redis-server 2>&1; true", timeout=120)
    # Never go on unless the host really sees its own database: an install must not touch this machine's packages.
    assert "install ok installed" not in done.stdout, f"{host.name} still sees the machine's dpkg database: {done.stdout}"


@pytest.fixture
def apt_hosts(hosts: TestHosts, tmp_path: Path) -> Iterator[TestHosts]:
    for tool in ("dpkg-deb", "apt-get"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing (Debian's dpkg and apt)")
    deb = lab_package(tmp_path)
    try:
        own_apt(hosts, hosts.hosts[1], None)
        own_apt(hosts, hosts.hosts[2], deb)
        yield hosts
    finally:
        for host in hosts.hosts[1:]:
            hosts.exec(host, "umount /var/cache/apt; umount /var/lib/apt/lists; umount /etc/apt; umount /var/lib/dpkg; true")
            shutil.rmtree(host.dir / "apt-lab", ignore_errors=True)


def test_multi_worker_router_installs_redis_server_and_a_failed_install_fails_only_that_host(apt_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    doc = topology_doc(apt_hosts)
    doc["router"] = {"workers": 2}
    doc["nodes"][1]["instances"].append({"role": "router", "port": 8000})  # a router on host2 too: its install fails
    topo = write_topology(tmp_path / "t.yaml", doc)
    planned = json.loads(bpdkv("plan", str(topo), "--output", "json").stdout)
    wants = {h["host"]: h.get("system_packages") for h in planned["hosts"]}
    assert wants["host2"] == ["redis-server"] and wants["host3"] == ["redis-server"] and not wants["host1"], wants

    applied = bpdkv("apply", str(topo), "-y")
    assert applied.returncode == 1, applied.stdout + applied.stderr
    lines = [line for line in applied.stderr.splitlines() if line.startswith("host2:")]
    assert (
        lines and "apt-get install redis-server failed (exit 100): E: Package 'redis-server' has no installation candidate" in lines[0]
    ), applied.stderr
    assert not list((apt_hosts.hosts[1].fs / "etc/bpdkv").iterdir())  # the failed install wrote nothing on host2
    host3 = apt_hosts.hosts[2]
    assert (host3.fs / MARKER.lstrip("/")).exists()  # host3's package really went in, through apt-get from its repo
    version = apt_hosts.exec(host3, "dpkg-query -W -f='${Version} ${Status}' redis-server").stdout
    assert version == "99:0-bpdkvlab install ok installed", version

    # The fact now says installed on host3 (no install planned there), still missing on host2.
    replanned = json.loads(bpdkv("plan", str(topo), "--output", "json").stdout)
    wants = {h["host"]: h.get("system_packages") for h in replanned["hosts"]}
    assert not wants["host3"] and wants["host2"] == ["redis-server"], wants
