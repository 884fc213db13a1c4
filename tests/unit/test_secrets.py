"""Secret references: resolution from env, file and a real moto server (Secrets Manager, SSM), masking, redacted diffs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bpdkv import secret_refs as secrets
from bpdkv.secret_refs import Resolver, SecretError, SecretRef, SecretValue


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real moto server on loopback; boto3 reaches it through AWS_ENDPOINT_URL like any user's endpoint."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    mp = pytest.MonkeyPatch()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        mp.setenv(name, value)
    mp.delenv("AWS_PROFILE", raising=False)
    try:
        yield f"http://{host}:{port}"
    finally:
        mp.undo()
        server.stop()


def test_env_and_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("hf_fromfile0123456789abcdefgh\n")
    resolver = Resolver(environ={"HF_TOKEN": "hf_fromenv0123456789abcdefgh"}, base_dir=tmp_path)
    from_env = resolver.resolve(SecretRef("env", "HF_TOKEN"))
    from_file = resolver.resolve(SecretRef("file", "token"))  # relative to the topology's folder; one newline dropped
    assert (from_env, from_file) == ("hf_fromenv0123456789abcdefgh", "hf_fromfile0123456789abcdefgh")
    assert isinstance(from_env, SecretValue) and from_env.ref.describe() == "env:HF_TOKEN"
    assert "hf_fromenv" not in repr(from_env)


def test_json_key_in_a_file(tmp_path: Path) -> None:
    (tmp_path / "creds.json").write_text(json.dumps({"password": "s3cr3t-pw", "user": "app"}))
    resolver = Resolver(environ={}, base_dir=tmp_path)
    assert resolver.resolve(SecretRef("file", "creds.json", key="password")) == "s3cr3t-pw"
    with pytest.raises(SecretError, match=r"no key 'nope' \(keys: password, user\)"):
        resolver.resolve(SecretRef("file", "creds.json", key="nope"))


def test_failures_name_the_reference_and_are_reported_together(tmp_path: Path) -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Holder:
        env: tuple[tuple[str, str], ...]

    model = Holder(
        env=(
            ("A", SecretRef("env", "MISSING_ONE", where="vllm.env.A")),
            ("B", SecretRef("file", str(tmp_path / "absent"), where="nodes[0].env.B")),
        )
    )
    with pytest.raises(SecretError) as info:
        secrets.resolve_topology(model, Resolver(environ={}))
    assert len(info.value.lines()) == 2  # one line per unresolvable reference
    message = "\n".join(info.value.lines())
    assert "vllm.env.A: secret env:MISSING_ONE: environment variable MISSING_ONE is not set" in message
    assert "nodes[0].env.B: secret file:" in message and "No such file" in message
    assert all("\n" not in line for line in info.value.lines())


def test_resolve_topology_replaces_every_reference() -> None:
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Inner:
        env: tuple[tuple[str, str], ...]

    @dataclass(frozen=True)
    class Outer:
        inner: tuple[Inner, ...]
        plain: str
        raw: dict[str, object] = field(compare=False, default_factory=dict)

    ref = SecretRef("env", "TOKEN_X")
    model = Outer((Inner((("T", ref), ("P", "plain"))),), "x", {"T": {"secret": {"env": "TOKEN_X"}}})
    assert secrets.find_refs(model) == [ref]
    resolved = secrets.resolve_topology(model, Resolver(environ={"TOKEN_X": "value-of-token-x"}))
    assert resolved.inner[0].env == (("T", "value-of-token-x"), ("P", "plain"))
    assert secrets.carries_secret(resolved.inner[0].env) and not secrets.carries_secret((("P", "plain"),))
    assert resolved.raw == model.raw  # the document keeps references, never values
    assert str(ref) == "<secret:env:TOKEN_X>"


def test_secrets_manager_and_ssm_from_a_moto_server(aws: str) -> None:
    import boto3

    sm = boto3.client("secretsmanager")
    sm.create_secret(Name="prod/hf", SecretString="hf_fromsecretsmanager0123456789")
    sm.create_secret(Name="prod/redis", SecretString=json.dumps({"password": "redis-pw-from-json", "user": "x"}))
    ssm = boto3.client("ssm")
    ssm.put_parameter(Name="/bpdkv/admin", Value="admin-key-from-ssm-0123", Type="SecureString")
    resolver = Resolver()
    assert resolver.resolve(SecretRef("aws_secretsmanager", "prod/hf")) == "hf_fromsecretsmanager0123456789"
    assert resolver.resolve(SecretRef("aws_secretsmanager", "prod/redis", key="password")) == "redis-pw-from-json"
    assert resolver.resolve(SecretRef("ssm", "/bpdkv/admin")) == "admin-key-from-ssm-0123"
    with pytest.raises(SecretError, match=r"secret aws_secretsmanager:prod/absent: AWS ResourceNotFoundException"):
        resolver.resolve(SecretRef("aws_secretsmanager", "prod/absent"))
    with pytest.raises(SecretError, match=r"secret ssm:/bpdkv/absent: AWS ParameterNotFound"):
        resolver.resolve(SecretRef("ssm", "/bpdkv/absent"))


def test_unreachable_endpoint_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(SecretError, match=r"secret ssm:/x: AWS: Could not connect"):
        Resolver().resolve(SecretRef("ssm", "/x"))


def test_masking_reaches_log_records(caplog: pytest.LogCaptureFixture) -> None:
    value = Resolver(environ={"MASKME": "mask-this-value-42"}).resolve(SecretRef("env", "MASKME"))
    with caplog.at_level(logging.INFO):
        logging.getLogger("bpdkv.test").info("connecting with %s to x", value)
    assert "mask-this-value-42" not in caplog.text and "<redacted>" in caplog.text
    assert secrets.mask(f"error: bad {value}") == "error: bad <redacted>"


def test_rotation_diff_shows_the_changed_line_never_a_value() -> None:
    old = "# header\nHF_TOKEN=hf_oldvalue0123456789abcdefgh\nVLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.1\n"
    new_value = Resolver(environ={"HF": "hf_newvalue0123456789abcdefgh"}).resolve(SecretRef("env", "HF"))
    new = f"# header\nHF_TOKEN={new_value}\nVLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.2\n"
    diff = secrets.secret_diff(old, new, "a", "b", env_file=True)
    assert "hf_oldvalue" not in diff and "hf_newvalue" not in diff
    assert "-HF_TOKEN=<redacted>\n" in diff and "+HF_TOKEN=<redacted>\n" in diff
    assert "+VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.2\n" in diff  # plain settings stay readable
    # a whole-secret file (key file, password, PEM): lines go entirely
    diff = secrets.secret_diff("tenant-a sha256:aaaa\n", "tenant-a sha256:bbbb\n", "a", "b")
    assert diff.splitlines()[-2:] == ["-<redacted>", "+<redacted>"]


def test_secret_rotated_under_an_innocent_name_is_redacted_on_both_sides() -> None:
    value = Resolver(environ={"X": "innocent-looking-but-secret"}).resolve(SecretRef("env", "X"))
    diff = secrets.secret_diff("MODEL_MIRROR=old-unknown-value\n", f"MODEL_MIRROR={value}\n", "a", "b", env_file=True)
    assert "old-unknown-value" not in diff and "innocent-looking" not in diff


def test_key_and_password_files_show_no_line_even_one_that_looks_like_key_value() -> None:
    # A PEM body's last base64 line may end in '=' padding and a password may hold '=': neither is KEY=value.
    old_pem = (
        "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0w\nAbcdefGhij0123456789klmnop==\n-----END PRIVATE KEY-----\n"
    )
    new_pem = (
        "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG1x\nQrstuvWxyz9876543210abcdef==\n-----END PRIVATE KEY-----\n"
    )
    for old, new in ((old_pem, new_pem), ("s3cretPart=tail\n", "n3wpass=word\n"), ("# not a comment\n", "# either\n")):
        diff = secrets.secret_diff(old, new, "host:/etc/bpdkv/router-0.tls.key", "rendered")
        shown = [line[1:] for line in diff.splitlines()[2:] if not line.startswith("@@")]
        assert shown and set(shown) == {"<redacted>"}, diff


def test_digest_is_stable_and_hides_content() -> None:
    digest = secrets.secret_digest("HF_TOKEN=abc\n")
    assert digest.startswith("sha256:") and "abc" not in digest and digest == secrets.secret_digest("HF_TOKEN=abc\n")


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        ({"vllm": {"env": {"HF_TOKEN": "whatever-text"}}}, ("vllm", "env", "HF_TOKEN")),
        ({"nodes": [{"env": {"MIRROR": "hf_" + "a" * 34}}]}, ("nodes", 0, "env", "MIRROR")),
        ({"vllm": {"env": {"OPENAI": "sk-" + "b" * 40}}}, ("vllm", "env", "OPENAI")),
        ({"vllm": {"env": {"AWS_ID": "AKIA" + "C" * 16}}}, ("vllm", "env", "AWS_ID")),
        ({"vllm": {"env": {"GH": "ghp_" + "d" * 36}}}, ("vllm", "env", "GH")),
        ({"router": {"state": "rediss://:hunter2hunter2@redis.internal:6380/0"}}, ("router", "state")),
        ({"vllm": {"env": {"DB_PASSWORD": "pw"}}}, ("vllm", "env", "DB_PASSWORD")),
    ],
)
def test_validate_warns_on_plaintext_secrets(doc: dict[str, object], path: tuple[object, ...]) -> None:
    findings = list(secrets.plaintext_secret_findings(doc))
    assert [p for p, _ in findings] == [path]
    message = findings[0][1]
    assert "{secret: {" in message and "docs/security.md" in message
    for leaf in ("whatever-text", "hunter2", "a" * 34, "b" * 40):
        assert leaf not in message


@pytest.mark.parametrize(
    "doc",
    [
        {"vllm": {"env": {"HF_TOKEN": {"secret": {"env": "HF_TOKEN"}}}}},
        {"router": {"api_keys_file": "/etc/bpdkv/keys", "state": "rediss://redis.internal:6380/0"}},
        {"ssh": {"identity_file": "~/.ssh/id_ed25519", "known_hosts": "/x"}},
        {"model": {"kv_cache_dtype": "fp8"}, "router": {"tls": {"key": "/etc/ssl/private/router.key"}}},
        {"vllm": {"env": {"VLLM_LOGGING_LEVEL": "DEBUG", "TOKENIZERS_PARALLELISM": "false"}}},
    ],
)
def test_no_warning_for_references_paths_and_plain_settings(doc: dict[str, object]) -> None:
    assert list(secrets.plaintext_secret_findings(doc)) == []
