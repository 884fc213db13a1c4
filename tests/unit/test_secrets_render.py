"""Secret references through load → model → render: placeholders without resolution, 0600 files with it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bpdkv import secret_refs as secrets
from bpdkv.render import render_topology
from bpdkv.router.config import config_from_dict
from bpdkv.router.security import KeyRing
from bpdkv.secret_refs import Resolver, SecretError
from bpdkv.topology.validate import validate_document
from bpdkv.topology.yaml_source import parse_yaml

HF = "hf_renderTest0123456789abcdefghij"
TENANT_KEY = "sk-tenant-render-0123456789abcd"
ADMIN = "admin-render-key-0123456789"
REDIS_PW = "redis-render-pw-0123"


def doc(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    return {
        "apiVersion": "bpdkv/v1",
        "name": "secrets-render",
        "profile": "tiny-cpu",
        "vllm": {"env": {"HF_TOKEN": {"secret": {"env": "BPDKV_TEST_HF"}}, "PLAIN_SETTING": "1"}},
        "router": {
            "state": "rediss://redis.internal:6380/0",
            "api_keys": {"team-a": {"secret": {"env": "BPDKV_TEST_TENANT"}}},
            "admin_key": {"secret": {"file": str(tmp_path / "admin.key")}},
            "redis_password": {"secret": {"env": "BPDKV_TEST_REDIS"}},
            "redis_ca_file": "/etc/ssl/certs/redis-ca.pem",
            "tls": {"cert": "/etc/ssl/router.crt", "key": {"secret": {"env": "BPDKV_TEST_TLS_KEY"}}},
        },
        "nodes": [
            {"name": "a", "host": "10.0.0.1", "hardware": "cpu", "instances": [{"role": "prefill"}, {"role": "router"}]},
            {"name": "b", "host": "10.0.0.2", "hardware": "cpu", "instances": [{"role": "decode"}]},
        ],
    }


ENV = {
    "BPDKV_TEST_HF": HF,
    "BPDKV_TEST_TENANT": TENANT_KEY,
    "BPDKV_TEST_REDIS": REDIS_PW,
    "BPDKV_TEST_TLS_KEY": "-----BEGIN PRIVATE KEY-----\nnot-a-real-key-body\n-----END PRIVATE KEY-----",
}


def _topology(tmp_path: Path) -> Any:
    return validate_document(parse_yaml(yaml.safe_dump(doc(tmp_path)), "t.yaml")).topology


def test_plain_render_writes_placeholders_only(tmp_path: Path) -> None:
    artifacts = render_topology(_topology(tmp_path))
    text = "".join(a.content for a in artifacts)
    for value in (HF, TENANT_KEY, ADMIN, REDIS_PW, "not-a-real-key-body"):
        assert value not in text
    env_file = next(a for a in artifacts if a.path.endswith("prefill-0.env"))
    assert "HF_TOKEN='<secret:env:BPDKV_TEST_HF>'" in env_file.content


def test_resolved_render_puts_values_only_in_0600_secret_files(tmp_path: Path) -> None:
    topology = secrets.resolve_topology(_topology(tmp_path), Resolver(environ=ENV))
    artifacts = render_topology(topology)
    by_path = {a.path: a for a in artifacts}
    holders = {a.path for a in artifacts if any(v in a.content for v in (HF, ADMIN, REDIS_PW, "not-a-real-key-body"))}
    assert holders == {
        "/etc/bpdkv/prefill-0.env",
        "/etc/bpdkv/decode-0.env",
        "/etc/bpdkv/router-admin.key",
        "/etc/bpdkv/router-0.redis-password",
        "/etc/bpdkv/router-0.tls.key",
    }
    assert all(by_path[p].mode == 0o600 and by_path[p].secret for p in holders)
    assert not any(TENANT_KEY in a.content for a in artifacts)  # inbound keys: digests only
    keys = by_path["/etc/bpdkv/router-0.api-keys"]
    assert keys.mode == 0o600 and KeyRing.parse(keys.content).tenant(TENANT_KEY) == "team-a"
    assert hashlib.sha256(TENANT_KEY.encode()).hexdigest() in keys.content
    config_text = by_path["/etc/bpdkv/router-0.router.yaml"].content
    config = config_from_dict(yaml.safe_load(config_text))  # the router accepts what render writes
    assert config.api_keys_file == "/etc/bpdkv/router-0.api-keys"
    assert config.admin_key_file == "/etc/bpdkv/router-admin.key" == topology.router.admin_key_file
    assert config.state_password_file == "/etc/bpdkv/router-0.redis-password"
    assert config.state_ca_file == "/etc/ssl/certs/redis-ca.pem"
    assert (config.tls_cert_file, config.tls_key_file) == ("/etc/ssl/router.crt", "/etc/bpdkv/router-0.tls.key")
    assert config.state == "rediss://redis.internal:6380/0"


@pytest.mark.parametrize("user", ["vllm", "root", None])
def test_secret_files_readable_by_the_service_user_only(tmp_path: Path, user: str | None) -> None:
    """A unit running as vllm.user reads its env file and the router's key files: group-readable by that user's group
    (0640, apply chowns root:<group>); as root (or no user) they stay 0600. Public files keep their own modes."""
    document = doc(tmp_path)
    if user:
        document["vllm"]["user"] = user
    topology = secrets.resolve_topology(validate_document(parse_yaml(yaml.safe_dump(document), "t.yaml")).topology, Resolver(environ=ENV))
    artifacts = render_topology(topology)
    secret_files = {a.path: (a.mode, a.reader) for a in artifacts if a.secret}
    shared = 0o640 if user == "vllm" else 0o600
    reader = "vllm" if user == "vllm" else None
    assert secret_files == {
        path: (shared, reader)
        for path in (
            "/etc/bpdkv/prefill-0.env",
            "/etc/bpdkv/decode-0.env",
            "/etc/bpdkv/router-0.env",
            "/etc/bpdkv/router-0.api-keys",
            "/etc/bpdkv/router-admin.key",
            "/etc/bpdkv/router-0.redis-password",
            "/etc/bpdkv/router-0.tls.key",
        )
    }
    assert all(a.reader is None for a in artifacts if not a.secret)
    assert {a.mode for a in artifacts if a.path.endswith(".service")} == {0o644}
    units = [a.content for a in artifacts if a.path.endswith(".service")]
    assert all(("User=vllm" in u) == (user == "vllm") for u in units)


def test_unresolvable_references_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(SecretError) as info:
        secrets.resolve_topology(_topology(tmp_path), Resolver(environ={}))
    lines = info.value.lines()
    names = ("BPDKV_TEST_HF", "BPDKV_TEST_TENANT", "BPDKV_TEST_REDIS", "BPDKV_TEST_TLS_KEY")
    # One line per unresolvable reference (docs/security.md), each naming its reference and nothing else.
    assert len(lines) == len(names) and all("\n" not in line for line in lines), lines
    for name in names:
        assert sum(f"environment variable {name} is not set" in line for line in lines) == 1, lines
    assert any(line.startswith("router.api_keys.team-a: secret env:BPDKV_TEST_TENANT") for line in lines)


def test_schema_rejects_a_malformed_reference(tmp_path: Path) -> None:
    from bpdkv.errors import InvalidTopology

    bad = doc(tmp_path)
    bad["vllm"]["env"]["HF_TOKEN"] = {"secret": {"env": "A", "ssm": "/b"}}
    with pytest.raises(InvalidTopology) as info:
        validate_document(parse_yaml(yaml.safe_dump(bad), "t.yaml"))
    assert any("vllm.env.HF_TOKEN" in line for line in info.value.lines())


def test_validate_warns_on_plaintext_and_never_quotes_it(tmp_path: Path) -> None:
    plain = doc(tmp_path)
    plain["vllm"]["env"]["HF_TOKEN"] = HF
    plain["router"]["state"] = f"rediss://:{REDIS_PW}@redis.internal:6380/0"
    validated = validate_document(parse_yaml(yaml.safe_dump(plain), "t.yaml"))
    warnings = [w for w in validated.warnings if "plain text" in w.message]
    assert sorted(w.path for w in warnings) == ["router.state", "vllm.env.HF_TOKEN"]
    assert all(w.line is not None for w in warnings)  # file:line like every other diagnostic
    assert not any(HF in w.format() or REDIS_PW in w.format() for w in validated.warnings)


def test_render_cli_placeholders_unless_include_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import stat

    from click.testing import CliRunner

    from bpdkv.cli import main

    topo = tmp_path / "t.yaml"
    topo.write_text(yaml.safe_dump(doc(tmp_path)))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    plain = CliRunner().invoke(main, ["render", str(topo), "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    assert not any(HF in p.read_text() for p in (tmp_path / "plain").rglob("*") if p.is_file())
    full = CliRunner().invoke(main, ["render", str(topo), "--out", str(tmp_path / "full"), "--include-secrets"])
    assert full.exit_code == 0, full.output
    env_file = tmp_path / "full/a/etc/bpdkv/prefill-0.env"
    assert HF in env_file.read_text() and stat.S_IMODE(os.stat(env_file).st_mode) == 0o600
    monkeypatch.delenv("BPDKV_TEST_HF")
    missing = CliRunner().invoke(main, ["render", str(topo), "--out", str(tmp_path / "x"), "--include-secrets"])
    assert missing.exit_code == 1 and "environment variable BPDKV_TEST_HF is not set" in missing.output
    assert not (tmp_path / "x").exists()  # nothing written when a reference fails
