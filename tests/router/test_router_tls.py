"""HTTPS router (self-signed CA made here, clients verify it; certificate reloaded on change) and hashed tenant keys;
Redis over TLS with a password shared by two routers (real redis-server)."""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group
from bpdkv.router.security import KeyRing, SecurityConfigError, hashed_key_line
from bpdkv.router.sessions import RedisStore, SessionEntry, StoreUnavailable
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import SYSTEM, chat

KEY_A = "sk-tenant-a-0123456789abcdef0123"
KEY_B = "plain-key-of-tenant-b-98765"


# ---- a CA and certificates, made in the test --------------------------------------------------------------------------
class CertificateAuthority:
    def __init__(self, folder: Path, name: str = "bpdkv test CA") -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / f"{name.replace(' ', '-')}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cert_path: Path, key_path: Path, serial: int, ip: str = "127.0.0.1") -> None:
        """A server certificate for ip, written beside and then moved over the paths (a renewal as certbot does it)."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"router-{serial}")]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        for path, data, mode in ((key_path, key_pem, 0o600), (cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)):
            tmp = path.with_suffix(".new")
            tmp.write_bytes(data)
            tmp.chmod(mode)
            os.replace(tmp, path)


def trust(ca: Path) -> ssl.SSLContext:
    """A client context trusting only `ca` (httpx deprecates verify=<path>)."""
    return ssl.create_default_context(cafile=str(ca))


def peer_serial(port: int, ca: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        cert = tls.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


# ---- HTTPS router: the real `bpdkv router` process ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def https_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("tls")
    ca = CertificateAuthority(folder)
    cert, key = folder / "router.crt", folder / "router.key"
    ca.issue(cert, key, serial=1001)
    keys = folder / "keys"
    keys.write_text(f"# tenants\n{hashed_key_line('team-a', KEY_A)}\nteam-b {KEY_B}\n")
    keys.chmod(0o600)
    # D streams a token every 20 ms, so a long answer is still in flight while the certificate is renewed.
    emulators = [VllmEmulator(EmulatorSettings(role="prefill")), VllmEmulator(EmulatorSettings(role="decode", token_interval=0.02))]
    group = ServerGroup([e.app for e in emulators])
    p_url, d_url = group.start()
    port = free_port()
    config = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": p_url}],
        "decode": [{"name": "decode-0", "url": d_url}],
        "api_keys_file": str(keys),
        "tls_cert_file": str(cert),
        "tls_key_file": str(key),
        "backend_api_key_env": None,
    }
    config_path = folder / "router.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = folder / "router.log"
    bpdkv = shutil.which("bpdkv") or sys.exit("bpdkv not installed")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [bpdkv, "router", "--config", str(config_path), "--log-level", "debug"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", verify=trust(ca.path), timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"router did not come up over HTTPS: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield {"url": url, "port": port, "ca": ca, "cert": cert, "key": key, "log": log_path, "folder": folder}
    finally:
        stop_group(proc, 10)
        group.stop()


def test_clients_verify_the_router_certificate(https_router: dict[str, Any]) -> None:
    url, ca = https_router["url"], https_router["ca"]
    assert httpx.get(url + "/health", verify=trust(ca.path), timeout=5).status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health", timeout=5)  # the system CAs do not know the self-signed one
    other = CertificateAuthority(https_router["folder"], "another CA")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health", verify=trust(other.path), timeout=5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{https_router['port']}/health", timeout=5)  # no plain HTTP on the port


def test_tenant_keys_by_hash_and_nowhere_in_logs_or_metrics(https_router: dict[str, Any]) -> None:
    url, ca = https_router["url"], trust(https_router["ca"].path)
    body = {"model": "emulated", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], "max_tokens": 8}
    for key in (KEY_A, KEY_B):
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, verify=ca, timeout=30)
        assert resp.status_code == 200, resp.text
    for headers in ({"authorization": "Bearer " + KEY_A[:-1] + "X"}, {}):
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, verify=ca, timeout=30)
        assert resp.status_code == 401
    assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY_B}"}, verify=ca, timeout=10).status_code == 200
    metrics = httpx.get(url + "/metrics", verify=ca, timeout=10).text
    log = https_router["log"].read_text()
    for text in (metrics, log):
        for secret in (KEY_A, KEY_B, hashlib.sha256(KEY_A.encode()).hexdigest()):
            assert secret not in text


def test_certificate_is_reloaded_on_change_without_restart(https_router: dict[str, Any]) -> None:
    port, ca = https_router["port"], https_router["ca"]
    assert peer_serial(port, ca.path) == 1001
    ca.issue(https_router["cert"], https_router["key"], serial=1002)
    deadline = time.monotonic() + 10
    while peer_serial(port, ca.path) != 1002:
        assert time.monotonic() < deadline, "the renewed certificate was not picked up within 10 s"
        time.sleep(0.2)
    assert httpx.get(https_router["url"] + "/health", verify=trust(ca.path), timeout=5).status_code == 200
    # A broken renewal (key and certificate that do not match) keeps the previous pair serving.
    https_router["key"].write_text("-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
    time.sleep(1.5)
    assert peer_serial(port, ca.path) == 1002
    assert "still serving the previous certificate" in https_router["log"].read_text()


def test_renewal_reaches_new_connections_while_an_open_stream_finishes(https_router: dict[str, Any]) -> None:
    """A stream over the old certificate keeps going through a renewal; a connection made meanwhile gets the new one."""
    port, ca = https_router["port"], https_router["ca"]
    body = {
        "model": "emulated",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a long answer please"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY_B}"}
    started = time.monotonic()
    with (
        httpx.Client(verify=trust(ca.path), timeout=30) as client,
        client.stream("POST", https_router["url"] + "/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        tls_object = resp.extensions["network_stream"].get_extra_info("ssl_object")
        stream_serial = int(str(tls_object.getpeercert()["serialNumber"]), 16)
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        ca.issue(https_router["cert"], https_router["key"], serial=3001)
        deadline = time.monotonic() + 10
        while peer_serial(port, ca.path) != 3001:
            assert time.monotonic() < deadline, "the renewed certificate was not picked up within 10 s"
            time.sleep(0.1)
        renewed_after = time.monotonic() - started
        rest = [line for line in lines if line.startswith("data: ")]
        finished_after = time.monotonic() - started
    assert stream_serial != 3001
    events = [first, *rest]
    assert events[-1] == "data: [DONE]", events[-3:]
    deltas = [e for e in events[:-1] if '"content"' in e]
    assert len(deltas) >= 299, len(deltas)  # every token arrived over the connection opened before the renewal
    assert finished_after > renewed_after + 1, (renewed_after, finished_after)  # the stream was still running


def test_keys_file_errors_name_the_line_not_the_key() -> None:
    with pytest.raises(SecurityConfigError, match=r"^keys:2: expected") as info:
        KeyRing.parse("good-key-1\nteam a b-secret-value\n", "keys")
    assert "b-secret-value" not in str(info.value)
    ring = KeyRing.parse(f"{hashed_key_line('t1', 'k-one-0000')}\nk-two-0000\n")
    assert ring.tenant("k-one-0000") == "t1"
    assert (ring.tenant("k-two-0000") or "").startswith("key-") and ring.tenant("nope") is None and ring.tenant(None) is None


# ---- Redis over TLS with a password, shared by two routers -------------------------------------------------------------
@pytest.fixture
def redis_tls(tmp_path: Path) -> Iterator[dict[str, Any]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server missing: apt-get install -y redis-server (make test installs it)")
    ca = CertificateAuthority(tmp_path, "redis CA")
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    ca.issue(cert, key, serial=7)
    password = "redis-pw-" + os.urandom(8).hex()
    password_file = tmp_path / "redis-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    port = free_port()
    # The password goes in a config file, not argv (ps shows argv to every user of the machine).
    conf = tmp_path / "redis.conf"
    conf.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca.path}\n"
        f'tls-auth-clients no\nrequirepass "{password}"\nsave ""\nappendonly no\ndir {tmp_path}\n'
    )
    conf.chmod(0o600)
    proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server with TLS did not start"
            time.sleep(0.05)
    try:
        yield {"url": f"rediss://127.0.0.1:{port}/0", "ca": ca.path, "password_file": password_file, "folder": tmp_path}
    finally:
        stop_group(proc, 5)


def test_two_routers_share_sessions_over_redis_tls_with_password(fleet_factory: Any, redis_tls: dict[str, Any]) -> None:
    changes = {"state": redis_tls["url"], "state_password_file": str(redis_tls["password_file"]), "state_ca_file": str(redis_tls["ca"])}
    fleet = fleet_factory(n_routers=2, p_settings={"prefix_caching": False}, router_changes=changes)
    a, b = fleet.router_urls
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn one"}]
    for turn in range(3):
        text, _ = chat(a if turn % 2 == 0 else b, messages)  # alternate replicas: the session must cross them
        assert text
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 2}"}]
    hits = fleet.metric("bpdkv_router_reuse_total", 0, outcome="hit") + fleet.metric("bpdkv_router_reuse_total", 1, outcome="hit")
    assert hits == 2
    assert fleet.metric("bpdkv_router_store_errors_total", 0) + fleet.metric("bpdkv_router_store_errors_total", 1) == 0


async def _put(store: RedisStore) -> None:
    try:
        await store.put("probe", SessionEntry(params={}, expires_at=0, history="h"), 5)
    finally:
        await store.close()


def test_redis_tls_refuses_without_password_or_with_another_ca(redis_tls: dict[str, Any]) -> None:
    import asyncio

    url = redis_tls["url"]
    password = redis_tls["password_file"].read_text().strip()
    with pytest.raises(StoreUnavailable):  # no password: NOAUTH
        asyncio.run(_put(RedisStore(url, timeout=1, ssl_ca_certs=str(redis_tls["ca"]))))
    other = CertificateAuthority(redis_tls["folder"], "other CA")
    with pytest.raises(StoreUnavailable):  # the server's certificate does not verify
        asyncio.run(_put(RedisStore(url, timeout=1, password=password, ssl_ca_certs=str(other.path))))


def test_apply_probes_reach_an_https_router_that_requires_keys(https_router: dict[str, Any]) -> None:
    """The health gate and the admin call apply makes on the router node (the same probe, run here locally)."""
    from types import SimpleNamespace

    from bpdkv.deploy.connectors import probe
    from bpdkv.deploy.connectors.local import LocalConnector
    from bpdkv.secret_refs import health_probe, router_base

    router = SimpleNamespace(tls_cert="/etc/bpdkv/router-0.tls.crt", api_keys=(("team-a", KEY_A),), api_keys_file=None)
    base, paths = health_probe("router", router, "127.0.0.1", https_router["port"])
    assert base.startswith("https://") and paths == ["/health"]
    node = LocalConnector()
    assert probe(node, base, paths, 10).failure is None
    # Why a keyed router's gate is /health alone: /v1/models answers only a tenant.
    assert "HTTP 401" in (probe(node, base, ["/v1/models"], 2, once=True).failure or "")
    listing = probe(node, router_base(router, "127.0.0.1", https_router["port"]), ["/admin/upstreams"], 5, once=True)
    assert listing.failure is None and "prefill-0" in listing.body  # admin over HTTPS from loopback (no admin key set)
