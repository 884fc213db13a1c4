"""plan → apply → converge → change → drift → destroy, against three real SSH hosts."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from pathlib import Path

import pytest

from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts


def version_of(address: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{address}:{port}/version", timeout=5) as resp:
        return resp.read().decode()


def test_full_lifecycle(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))

    first = bpdkv("plan", str(topo), "--output", "json")
    assert first.returncode == 2, first.stderr
    plan = json.loads(first.stdout)
    assert {f["action"] for h in plan["hosts"] for f in h["files"]} == {"create"}
    assert [w["role"] for w in plan["waves"]] == ["prefill", "decode", "router"]

    applied = bpdkv("apply", str(topo), "-y")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert version_of("10.213.0.11", 8100) == "v1"
    manifest = json.loads((hosts.hosts[0].fs / "etc/bpdkv/manifest.json").read_text())
    assert manifest["topology"] == "hosts-test" and "/etc/systemd/system/bpdkv-prefill-0.service" in manifest["files"]

    again = bpdkv("plan", str(topo))
    assert again.returncode == 0, again.stdout + again.stderr  # converged: no changes

    # one value changes → exactly that diff and that restart (+ decode after a prefill restart)
    doc = topology_doc(hosts)
    doc["nodes"][0]["instances"][0]["env"] = {"FAKE_VERSION": "v2"}
    write_topology(topo, doc)
    changed = bpdkv("plan", str(topo), "--output", "json")
    assert changed.returncode == 2
    plan = json.loads(changed.stdout)
    files = [(h["host"], f["path"], f["action"]) for h in plan["hosts"] for f in h["files"] if f["action"] != "none"]
    assert files == [("host1", "/etc/bpdkv/prefill-0.env", "update")]
    diff = plan["hosts"][0]["files"][[f["path"] for f in plan["hosts"][0]["files"]].index("/etc/bpdkv/prefill-0.env")]["diff"]
    assert "-FAKE_VERSION=v1" in diff and "+FAKE_VERSION=v2" in diff
    units = {(h["host"], u["unit"]): (u["action"], u["reason"]) for h in plan["hosts"] for u in h["units"]}
    assert units[("host1", "bpdkv-prefill-0.service")] == ("restart", "changed: env")
    assert units[("host2", "bpdkv-decode-0.service")][0] == "restart" and "stale NIXL" in units[("host2", "bpdkv-decode-0.service")][1]
    assert units[("host3", "bpdkv-router-0.service")][0] == "none"
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    assert version_of("10.213.0.11", 8100) == "v2"
    assert bpdkv("plan", str(topo)).returncode == 0

    # hand edit on a host → drift reported, apply restores
    launch = hosts.hosts[1].fs / "opt/bpdkv/bin/decode-0.sh"
    launch.write_text(launch.read_text() + "# edited by hand\n")
    drift = bpdkv("plan", str(topo), "--output", "json")
    assert drift.returncode == 2
    host2 = json.loads(drift.stdout)["hosts"][1]
    edited = [f for f in host2["files"] if f["action"] != "none"]
    assert [(f["path"], f["drift"]) for f in edited] == [("/opt/bpdkv/bin/decode-0.sh", True)]
    status = bpdkv("status", str(topo), "--output", "json")
    assert status.returncode == 1 and json.loads(status.stdout)["instances"][1]["drift"] == ["/opt/bpdkv/bin/decode-0.sh"]
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    healthy = bpdkv("status", str(topo), "--output", "json")
    assert healthy.returncode == 0, healthy.stdout
    assert all(i["state"] == "active" and i["health"] == "ok" for i in json.loads(healthy.stdout)["instances"])

    destroyed = bpdkv("destroy", str(topo), "-y")
    assert destroyed.returncode == 0, destroyed.stdout + destroyed.stderr
    for host in hosts.hosts:
        assert [p.name for p in (host.fs / "etc/systemd/system").rglob("bpdkv-*")] == []  # units and enable links gone
        assert sorted(p.name for p in (host.fs / "etc/bpdkv").iterdir()) == []  # (the mount point itself stays)
        assert sorted(p.name for p in (host.fs / "opt/bpdkv").iterdir()) == ["venv"]  # not ours: untouched
    assert bpdkv("plan", str(topo), "--output", "json").returncode == 2  # everything to create again


def test_saved_plan_refused_after_drift(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    doc = topology_doc(hosts)
    doc["nodes"][2]["instances"][0]["env"] = {"X": "1"}
    write_topology(topo, doc)
    saved = tmp_path / "plan.json"
    assert bpdkv("plan", str(topo), "--out", str(saved)).returncode == 2
    # Four kinds of drift on three hosts: each is named (host, file or unit, what differs), one line each.
    env = hosts.hosts[0].fs / "etc/bpdkv/prefill-0.env"
    before = hashlib.sha256(env.read_bytes()).hexdigest()[:12]
    env.write_text("# tampered\n")
    after = hashlib.sha256(env.read_bytes()).hexdigest()[:12]
    (hosts.hosts[1].fs / "opt/bpdkv/bin/decode-0.sh").chmod(0o700)
    assert hosts.exec(hosts.hosts[2], "chown nobody:nogroup /etc/bpdkv/router-0.router.yaml").returncode == 0
    assert hosts.exec(hosts.hosts[1], "systemctl stop bpdkv-decode-0.service").returncode == 0
    refused = bpdkv("apply", str(saved))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("saved plan refused: ")]
    expected = [
        f"host1: /etc/bpdkv/prefill-0.env: content sha256 {before} → {after}",
        "host2: /opt/bpdkv/bin/decode-0.sh: mode 755 → 700",
        "host2: unit bpdkv-decode-0.service: active → inactive",
        "host3: /etc/bpdkv/router-0.router.yaml: owner root → nobody",
        "host3: /etc/bpdkv/router-0.router.yaml: group root → nogroup",
    ]
    said = [line.removeprefix("saved plan refused: ").split(" (since the plan was saved")[0] for line in lines]
    assert said == expected, refused.stderr
    assert version_of("10.213.0.11", 8100) == "v1"  # nothing applied
    assert bpdkv("plan", str(topo), "--out", str(saved)).returncode == 2
    ok = bpdkv("apply", str(saved))
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_unreachable_host_means_nothing_written_anywhere(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    down = hosts.hosts[2]
    hosts.kill_host(down)
    try:
        result = bpdkv("apply", str(topo), "-y")
        assert result.returncode == 1
        assert "host3: reachable: unreachable" in result.stderr, result.stderr
        for host in hosts.hosts[:2]:
            assert list((host.fs / "etc/bpdkv").iterdir()) == []  # preflight failed on host3: nothing written on any host
        # --limit leaves the dead host out: the others are applied
        limited = bpdkv("apply", str(topo), "-y", "--limit", "host1", "--limit", "decode")
        assert limited.returncode == 0, limited.stdout + limited.stderr
        assert (hosts.hosts[0].fs / "etc/bpdkv/manifest.json").exists() and (hosts.hosts[1].fs / "etc/bpdkv/manifest.json").exists()
    finally:
        hosts.restart_host(down)
    rerun = bpdkv("apply", str(topo), "-y")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert bpdkv("plan", str(topo)).returncode == 0


def test_failed_health_gate_rolls_back(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    assert bpdkv("apply", str(topo), "-y").returncode == 0
    doc = topology_doc(hosts)
    doc["nodes"][1]["instances"][0]["env"] = {"FAKE_HEALTH": "fail", "FAKE_VERSION": "broken"}
    write_topology(topo, doc)
    result = bpdkv("apply", str(topo), "-y", "--start-timeout", "3")
    assert result.returncode == 1
    assert "host2: rolled back: bpdkv-decode-0.service: health gate failed" in result.stderr
    assert "FAKE_HEALTH" not in (hosts.hosts[1].fs / "etc/bpdkv/decode-0.env").read_text()
    assert version_of("10.213.0.12", 8200) == "v1"  # the old version runs again
    # manifest of host2 is the old one: the next plan still wants the change
    assert bpdkv("plan", str(topo)).returncode == 2


def test_ssh_errors_are_one_line(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    doc = topology_doc(hosts)
    empty_known = tmp_path / "known_hosts"
    empty_known.write_text("")
    doc["ssh"]["known_hosts"] = str(empty_known)
    topo = write_topology(tmp_path / "t.yaml", doc)
    result = bpdkv("plan", str(topo))
    assert result.returncode == 1
    # One line per failed host, on stderr with the other errors (issue 42 item 3: the plan body no longer repeats it).
    assert "unknown host key for 10.213.0.11" in result.stderr and "unknown host key" not in result.stdout
    accepted = bpdkv("plan", str(topo), "--accept-new-host-keys")
    assert accepted.returncode == 2 and "10.213.0.11" in empty_known.read_text()
    doc["ssh"]["known_hosts"] = str(hosts.known_hosts)
    other_key = tmp_path / "other"
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    doc["ssh"]["identity_file"] = str(other_key)
    write_topology(topo, doc)
    denied = bpdkv("plan", str(topo))
    assert denied.returncode == 1 and "authentication failed for root@10.213.0.11" in denied.stderr
    assert "Traceback" not in denied.stdout + denied.stderr
