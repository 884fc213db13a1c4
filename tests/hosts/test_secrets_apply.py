"""Secret references through a real apply (three SSH test hosts, fake vLLM), then a scan of everything bpdkv wrote or
printed for the secret values: they may appear only in 0600 files on the nodes. Rotation plans a restart, redacted."""

from __future__ import annotations

import json
import os
import secrets as random_secrets
import ssl
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bpdkv.lab.hosts import PER_HOST_DIRS
from tests.hosts.conftest import bpdkv, topology_doc, write_topology
from tests.router.test_router_tls import CertificateAuthority
from tests.unit.test_secrets import aws  # noqa: F401 - the moto server fixture

pytestmark = pytest.mark.hosts


def _value(prefix: str) -> str:
    return prefix + random_secrets.token_hex(16)


def _scan(texts: dict[str, str], values: dict[str, str]) -> list[str]:
    return [f"{name} holds {label}" for name, text in texts.items() for label, v in values.items() if v in text]


def _node_files(hosts: Any) -> Iterator[tuple[str, Path]]:
    for host in hosts.hosts:
        for d in PER_HOST_DIRS:
            root = host.fs / d.lstrip("/")
            for path in root.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    yield f"{host.name}:/{path.relative_to(host.fs)}", path


@pytest.mark.usefixtures("aws")
def test_secret_values_only_in_0600_node_files(hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import boto3

    values = {
        "hf token (env)": _value("hf_"),
        "tenant key (file)": _value("sk-tenant-"),
        "admin key (secrets manager)": _value("admin-"),
        "redis password (ssm)": _value("redispw-"),
    }
    monkeypatch.setenv("BPDKV_SCAN_HF", values["hf token (env)"])
    operator_secrets = tmp_path / "operator"
    operator_secrets.mkdir(mode=0o700)
    (operator_secrets / "tenant.key").write_text(values["tenant key (file)"] + "\n")
    ca = CertificateAuthority(operator_secrets)  # the router serves HTTPS with a pair from secret references
    ca.issue(operator_secrets / "router.crt", operator_secrets / "router.key", serial=42, ip="10.213.0.13")
    values["tls key (file)"] = (operator_secrets / "router.key").read_text().splitlines()[1]  # a line of the key's body
    boto3.client("secretsmanager").create_secret(
        Name="bpdkv/scan", SecretString=json.dumps({"admin": values["admin key (secrets manager)"]})
    )
    boto3.client("ssm").put_parameter(Name="/bpdkv/scan/redis", Value=values["redis password (ssm)"], Type="SecureString")

    doc = topology_doc(hosts)
    doc["vllm"]["env"]["HF_TOKEN"] = {"secret": {"env": "BPDKV_SCAN_HF"}}
    doc["router"] = {
        "state": "rediss://10.213.0.13:6380/0",
        "api_keys": {"team-a": {"secret": {"file": "operator/tenant.key"}}},  # relative to the topology's folder
        "admin_key": {"secret": {"aws_secretsmanager": "bpdkv/scan", "key": "admin"}},
        "redis_password": {"secret": {"ssm": "/bpdkv/scan/redis"}},
        "tls": {"cert": {"secret": {"file": "operator/router.crt"}}, "key": {"secret": {"file": "operator/router.key"}}},
    }
    topo = write_topology(tmp_path / "t.yaml", doc)
    outputs: dict[str, str] = {}

    def run(label: str, *args: str, expect: int) -> str:
        result = bpdkv(*args)
        outputs[f"`bpdkv {label}` stdout"] = result.stdout
        outputs[f"`bpdkv {label}` stderr"] = result.stderr
        assert result.returncode == expect, f"{label}: rc {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    run("validate", "validate", str(topo), expect=0)
    run("render", "render", str(topo), "--out", str(tmp_path / "rendered"), expect=0)
    plan = json.loads(run("plan --output json", "plan", str(topo), "--output", "json", expect=2))
    assert {f["action"] for h in plan["hosts"] for f in h["files"]} == {"create"}
    saved = tmp_path / "plan.json"
    run("plan --out", "plan", str(topo), "--out", str(saved), expect=2)
    run("apply saved plan", "apply", str(saved), expect=0)
    run("plan after apply", "plan", str(topo), expect=0)  # converged: resolution is stable, digests match
    run("status", "status", str(topo), "--output", "json", expect=0)
    # The router serves HTTPS (the gate above probed it so); a client that verifies with the CA gets through.
    with urllib.request.urlopen(
        "https://10.213.0.13:8000/health", timeout=5, context=ssl.create_default_context(cafile=str(ca.path))
    ) as resp:
        assert resp.status == 200

    # Rotation: a new HF token is a planned restart of every instance using it, and the diff shows no value.
    old_hf = values["hf token (env)"]
    values["hf token (rotated)"] = _value("hf_")
    monkeypatch.setenv("BPDKV_SCAN_HF", values["hf token (rotated)"])
    rotated = json.loads(run("plan after rotation", "plan", str(topo), "--output", "json", expect=2))
    changed = {(h["host"], f["path"]): f["diff"] for h in rotated["hosts"] for f in h["files"] if f["action"] != "none"}
    assert set(changed) == {("host1", "/etc/bpdkv/prefill-0.env"), ("host2", "/etc/bpdkv/decode-0.env")}
    for diff in changed.values():
        assert "-HF_TOKEN=<redacted>" in diff and "+HF_TOKEN=<redacted>" in diff
    actions = {u["instance"]: (u["action"], u["reason"]) for h in rotated["hosts"] for u in h["units"]}
    assert actions["prefill-0"] == ("restart", "changed: env") and actions["decode-0"][0] == "restart"
    assert actions["router-0"][0] == "none"
    run("plan after rotation (text)", "plan", str(topo), expect=2)
    saved_rotated = tmp_path / "plan-rotated.json"
    run("plan --out (rotated)", "plan", str(topo), "--out", str(saved_rotated), expect=2)
    monkeypatch.setenv("BPDKV_SCAN_HF", old_hf)
    # apply re-resolves and re-renders a saved plan: the secret it was made with is gone, so it is refused.
    run("apply stale saved plan", "apply", str(saved_rotated), expect=1)
    assert "plan again" in outputs["`bpdkv apply stale saved plan` stderr"]

    # Rotation of a router secret (the tenant key) restarts only the router; applied for real.
    values["tenant key (rotated)"] = _value("sk-tenant-")
    (operator_secrets / "tenant.key").write_text(values["tenant key (rotated)"] + "\n")
    router_rotation = json.loads(run("plan tenant rotation", "plan", str(topo), "--output", "json", expect=2))
    actions = {u["instance"]: u["action"] for h in router_rotation["hosts"] for u in h["units"]}
    assert actions == {"prefill-0": "none", "decode-0": "none", "router-0": "restart"}
    run("apply tenant rotation", "apply", str(topo), "-y", expect=0)

    # A renewed TLS pair: both files update (redacted) and the router is not restarted (it re-reads them on change).
    ca.issue(operator_secrets / "router.crt", operator_secrets / "router.key", serial=43, ip="10.213.0.13")
    values["tls key (renewed)"] = (operator_secrets / "router.key").read_text().splitlines()[1]
    renewal = json.loads(run("plan tls renewal", "plan", str(topo), "--output", "json", expect=2))
    changed = {(h["host"], f["path"]): f["diff"] for h in renewal["hosts"] for f in h["files"] if f["action"] != "none"}
    assert set(changed) == {("host3", "/etc/bpdkv/router-0.tls.crt"), ("host3", "/etc/bpdkv/router-0.tls.key")}
    assert all(
        line in ("+<redacted>", "-<redacted>")
        for line in changed[("host3", "/etc/bpdkv/router-0.tls.key")].splitlines()[3:]
        if line[:1] in "+-"
    ), changed
    actions = {u["instance"]: u["action"] for h in renewal["hosts"] for u in h["units"]}
    assert actions == {"prefill-0": "none", "decode-0": "none", "router-0": "none"}
    reasons = {u["instance"]: u["reason"] for h in renewal["hosts"] for u in h["units"]}
    assert reasons["router-0"] == "re-reads its changed TLS certificate, TLS key without a restart", reasons
    assert reasons["prefill-0"] == "up to date"

    # A missing secret: one line naming the reference, exit 1, nothing changed on any host.
    monkeypatch.delenv("BPDKV_SCAN_HF")
    before = {name: path.read_bytes() for name, path in _node_files(hosts)}
    failed = bpdkv("apply", str(topo), "-y")
    assert failed.returncode == 1 and "secret env:BPDKV_SCAN_HF: environment variable BPDKV_SCAN_HF is not set" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert {name: path.read_bytes() for name, path in _node_files(hosts)} == before

    # The scan. Operator side: every output, the saved plan, the plain render. None may hold a value.
    texts = dict(outputs)
    texts["saved plan"] = saved.read_text()
    texts["saved plan (rotated)"] = saved_rotated.read_text()
    for path in (tmp_path / "rendered").rglob("*"):
        if path.is_file():
            texts[f"rendered {path.relative_to(tmp_path)}"] = path.read_text()
    assert _scan(texts, values) == []
    # Nodes: values only in 0600 files (env files, the router's admin key and Redis password; inbound keys as digests).
    holders = {}
    for name, path in _node_files(hosts):
        found = [label for label, v in values.items() if v in path.read_text(errors="replace")]
        if found:
            holders[name] = (oct(stat.S_IMODE(os.stat(path).st_mode)), found)
    assert {name: mode for name, (mode, _) in holders.items()} == {
        "host1:/etc/bpdkv/prefill-0.env": "0o600",
        "host2:/etc/bpdkv/decode-0.env": "0o600",
        "host3:/etc/bpdkv/router-admin.key": "0o600",
        "host3:/etc/bpdkv/router-0.redis-password": "0o600",
        "host3:/etc/bpdkv/router-0.tls.key": "0o600",
    }, holders
    assert not any("tenant" in label for _, found in holders.values() for label in found)
    keys = (hosts.hosts[2].fs / "etc/bpdkv/router-0.api-keys").read_text()
    assert keys.count("team-a sha256:") == 1 and stat.S_IMODE(os.stat(hosts.hosts[2].fs / "etc/bpdkv/router-0.api-keys").st_mode) == 0o600


def test_a_non_root_service_reads_its_secrets_and_no_other_user_can(hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """vllm.user: nobody. Every unit runs as nobody and starts only if it can read its secret files (P/D source their
    env file, the router loads its TLS key); the files are root:nogroup 0640, so the user `daemon` reads none of them."""
    token = _value("hf_")
    monkeypatch.setenv("BPDKV_SCAN_HF", token)
    operator_secrets = tmp_path / "operator"
    operator_secrets.mkdir(mode=0o700)
    (operator_secrets / "tenant.key").write_text(_value("sk-tenant-") + "\n")
    (operator_secrets / "admin.key").write_text(_value("admin-") + "\n")
    ca = CertificateAuthority(operator_secrets)
    ca.issue(operator_secrets / "router.crt", operator_secrets / "router.key", serial=7, ip="10.213.0.13")
    doc = topology_doc(hosts)
    doc["vllm"]["user"] = "nobody"
    # fake_vllm answers /version with FAKE_VERSION: from a secret, it proves the service read its env file.
    doc["vllm"]["env"]["FAKE_VERSION"] = {"secret": {"env": "BPDKV_SCAN_HF"}}
    doc["router"] = {
        "api_keys": {"team-a": {"secret": {"file": "operator/tenant.key"}}},
        "admin_key": {"secret": {"file": "operator/admin.key"}},
        "tls": {"cert": {"secret": {"file": "operator/router.crt"}}, "key": {"secret": {"file": "operator/router.key"}}},
    }
    topo = write_topology(tmp_path / "t.yaml", doc)
    applied = bpdkv("apply", str(topo), "-y")
    assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr[-3000:]

    for host in hosts.hosts:
        users = hosts.exec(host, "ps -eo user:16,args | grep /opt/bpdkv/venv/bin/ | grep -v grep").stdout.split()
        assert users[:1] == ["nobody"], (host.name, users)
    with urllib.request.urlopen("http://10.213.0.11:8100/version", timeout=5) as resp:
        assert resp.read().decode() == token  # P read the env file as nobody
    with urllib.request.urlopen(
        "https://10.213.0.13:8000/health", timeout=5, context=ssl.create_default_context(cafile=str(ca.path))
    ) as resp:
        assert resp.status == 200  # the router (as nobody) loaded its TLS key

    readable = {
        (0, "/etc/bpdkv/prefill-0.env"),
        (1, "/etc/bpdkv/decode-0.env"),
        (2, "/etc/bpdkv/router-0.env"),
        (2, "/etc/bpdkv/router-0.api-keys"),
        (2, "/etc/bpdkv/router-admin.key"),
        (2, "/etc/bpdkv/router-0.tls.key"),
    }
    for index, path in sorted(readable):
        host = hosts.hosts[index]
        info = os.stat(host.fs / path.lstrip("/"))
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 65534, 0o640), (host.name, path)
        as_nobody = hosts.exec(host, f"setpriv --reuid=nobody --regid=nogroup --clear-groups cat {path}")
        assert as_nobody.returncode == 0, as_nobody.stderr
        as_daemon = hosts.exec(host, f"setpriv --reuid=daemon --regid=daemon --clear-groups cat {path}")
        assert as_daemon.returncode != 0 and "Permission denied" in as_daemon.stderr, (path, as_daemon.stdout)
    assert (hosts.hosts[2].fs / "etc/bpdkv/router-0.tls.crt").stat().st_mode & 0o777 == 0o644  # public

    # Another service user, nothing else changed: the unchanged secret files are planned again for their group.
    doc["vllm"]["user"] = "daemon"
    # P and D restart drained through the (fake) router, which records drains in a root-owned log it now cannot open.
    hosts.exec(hosts.hosts[2], "touch /var/log/fake-router-admin.log && chmod 666 /var/log/fake-router-admin.log")
    switched = json.loads(bpdkv("plan", str(write_topology(tmp_path / "t.yaml", doc)), "--output", "json").stdout)
    updated = {(h["host"], f["path"]) for h in switched["hosts"] for f in h["files"] if f["action"] == "update"}
    assert {(hosts.hosts[i].name, p) for i, p in readable} <= updated, updated
    applied = bpdkv("apply", str(tmp_path / "t.yaml"), "-y")
    assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr[-3000:]
    for index, path in sorted(readable):
        info = os.stat(hosts.hosts[index].fs / path.lstrip("/"))
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 1, 0o640), path  # root:daemon
        as_nobody = hosts.exec(hosts.hosts[index], f"setpriv --reuid=nobody --regid=nogroup --clear-groups cat {path}")
        assert as_nobody.returncode != 0 and "Permission denied" in as_nobody.stderr, path
    assert bpdkv("plan", str(tmp_path / "t.yaml")).returncode == 0  # converged

    # A service user the host does not have: refused before anything is written, one line per host.
    doc["vllm"]["user"] = "bpdkv-no-such-user"
    before = {name: path.read_bytes() for name, path in _node_files(hosts)}
    failed = bpdkv("apply", str(write_topology(tmp_path / "t.yaml", doc)), "-y")
    assert failed.returncode == 1, failed.stdout[-2000:]
    said = sorted(line for line in failed.stderr.splitlines() if "does not exist" in line)
    assert said == [
        f"{h.name}: user: user bpdkv-no-such-user (vllm.user) does not exist on this host; create it or change vllm.user"
        for h in hosts.hosts
    ], failed.stderr
    assert "Traceback" not in failed.stderr
    after = {name: path.read_bytes() for name, path in _node_files(hosts)}
    assert {name for name in before.keys() | after.keys() if before.get(name) != after.get(name) and "/etc/" in name} == set()
