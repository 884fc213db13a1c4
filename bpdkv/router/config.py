"""Router configuration: the file `bpdkv render` writes (schemas/router.schema.json), or flags."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from bpdkv.contracts import (
    ROUTER_CLIENT_TIMEOUT_DEFAULTS,
    ROUTER_DEFAULTS,
    ROUTER_HEALTH_DEFAULTS,
    ROUTER_PATHS_DEFAULTS,
    ROUTER_TIMEOUT_DEFAULTS,
)
from bpdkv.contracts import local_redis_conf as local_redis_conf  # re-exported: the router's tests and benchmarks
from bpdkv.errors import BpdkvError
from bpdkv.resources import schemas_dir


class RouterConfigError(BpdkvError):
    pass


@dataclass(frozen=True)
class UpstreamSpec:
    name: str
    url: str
    generation: str = ""  # "": the one unnamed generation of a config without generations


@dataclass(frozen=True)
class GenerationSpec:
    """A generation of P and D (bpdkv/generations.py) and what its engines must report (None: not checked)."""

    id: str
    vllm: str | None = None
    model_root: str | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timeouts:
    connect: float = ROUTER_TIMEOUT_DEFAULTS["connect"]
    prefill: float = ROUTER_TIMEOUT_DEFAULTS["prefill"]
    decode_first_byte: float = ROUTER_TIMEOUT_DEFAULTS["decode_first_byte"]
    decode_idle: float = ROUTER_TIMEOUT_DEFAULTS["decode_idle"]


@dataclass(frozen=True)
class ClientTimeouts:
    """Slow clients (408, connection closed): the request head, from the connection or the previous response; the body."""

    header: float = ROUTER_CLIENT_TIMEOUT_DEFAULTS["header"]
    body: float = ROUTER_CLIENT_TIMEOUT_DEFAULTS["body"]


@dataclass(frozen=True)
class PathSettings:
    """Per-turn paths (router/paths.py): when a continued turn runs on the D that holds it (decode_local)."""

    local_max_tokens: int = int(ROUTER_PATHS_DEFAULTS["local_max_tokens"])  # 0: every turn through P
    chars_per_token: float = ROUTER_PATHS_DEFAULTS["chars_per_token"]
    local_max_waiting: int = int(ROUTER_PATHS_DEFAULTS["local_max_waiting"])
    local_max_kv_usage: float = ROUTER_PATHS_DEFAULTS["local_max_kv_usage"]
    local_max_step_cost: float = ROUTER_PATHS_DEFAULTS["local_max_step_cost"]  # share of D's step; 0: token cap only
    load_interval: float = ROUTER_PATHS_DEFAULTS["load_interval"]


@dataclass(frozen=True)
class HealthSettings:
    interval: float = ROUTER_HEALTH_DEFAULTS["interval"]
    failures_to_eject: int = int(ROUTER_HEALTH_DEFAULTS["failures_to_eject"])
    backoff_max: float = ROUTER_HEALTH_DEFAULTS["backoff_max"]

    @property
    def check_timeout(self) -> float:
        """One check's bound: the interval, at most 5 s (interval 0, no periodic checks: 5 s)."""
        return min(self.interval or 5.0, 5.0)


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[UpstreamSpec, ...]
    decode: tuple[UpstreamSpec, ...]
    listen: str = ROUTER_DEFAULTS["listen"]
    port: int = ROUTER_DEFAULTS["port"]
    model: str | None = None
    state: str = ROUTER_DEFAULTS["state"]
    session_identity: str = ROUTER_DEFAULTS["session_identity"]
    session_ttl: float = ROUTER_DEFAULTS["session_ttl"]
    expiry_margin: float = ROUTER_DEFAULTS["expiry_margin"]
    reuse: bool = ROUTER_DEFAULTS["reuse"]
    api_keys_file: str | None = None
    backend_api_key_env: str | None = ROUTER_DEFAULTS["backend_api_key_env"]
    timeouts: Timeouts = field(default_factory=Timeouts)
    health: HealthSettings = field(default_factory=HealthSettings)
    client_timeouts: ClientTimeouts = field(default_factory=ClientTimeouts)
    paths: PathSettings = field(default_factory=PathSettings)
    topology: str | None = None
    workers: int | str = ROUTER_DEFAULTS["workers"]  # N or "auto" (router/workers.py: auto_workers)
    max_body_bytes: int = ROUTER_DEFAULTS["max_body_bytes"]
    max_json_depth: int = ROUTER_DEFAULTS["max_json_depth"]
    max_header_bytes: int = ROUTER_DEFAULTS["max_header_bytes"]
    admin_key_file: str | None = ROUTER_DEFAULTS["admin_key_file"]
    # HTTPS and Redis credentials (bpdkv.router.security): files on the node, 0600 where secret.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    state_password_file: str | None = None
    state_ca_file: str | None = None
    # redis-server config the router runs as its own child (workers > 1 without an external Redis; render writes it).
    local_redis_conf: str | None = None
    generations: tuple[GenerationSpec, ...] = ()  # oldest first; P and D pair only within one (router/generations.py)
    # The file it was loaded from, which the router watches (router/reload.py); None: built from flags, not watched.
    config_file: str | None = None

    def worker_count(self) -> int:
        if self.workers == "auto":
            from bpdkv.router.workers import auto_workers

            return auto_workers()
        return max(1, int(self.workers))


def _upstreams(items: list[Any], role: str) -> tuple[UpstreamSpec, ...]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"url": item}
        out.append(
            UpstreamSpec(name=item.get("name") or f"{role}-{i}", url=item["url"].rstrip("/"), generation=item.get("generation") or "")
        )
    return tuple(out)


def config_problems(config: RouterConfig, source: str = "router config") -> list[str]:
    """Rules across keys the schema cannot say."""
    problems = []
    if config.worker_count() > 1 and config.state == "memory":
        problems.append(
            f"{source}: workers: {config.workers} processes need shared sessions; set state to a redis:// URL "
            "(render does: a local redis-server on the router node)"
        )
    problems += generation_problems(config, source)
    if config.state.startswith(("redis+sentinel://", "rediss+sentinel://")):
        from bpdkv.router.resp import parse_sentinel_url

        try:
            parse_sentinel_url(config.state)
        except ValueError as exc:
            problems.append(f"{source}: state: {exc}")
    if config.worker_count() > 1 and config.port == 0:
        problems.append(f"{source}: port: workers share one fixed port; 0 (any free port) would give each its own")
    return problems


def generation_problems(config: RouterConfig, source: str = "router config") -> list[str]:
    """Every upstream names a listed generation once any does (else P and D could pair across one)."""
    known = [g.id for g in config.generations]
    problems = [f"{source}: generations: {g} is listed twice" for g in sorted({g for g in known if known.count(g) > 1})]
    for role, members in (("prefill", config.prefill), ("decode", config.decode)):
        for u in members:
            if u.generation and u.generation not in known:
                problems.append(f"{source}: {role} {u.name}: generation {u.generation!r} is not in generations")
            elif not u.generation and known:
                problems.append(f"{source}: {role} {u.name}: no generation (every upstream needs one when generations are listed)")
    return problems


def config_from_dict(data: dict[str, Any], source: str = "router config", validate: bool = True) -> RouterConfig:
    if validate:
        schema = json.loads((schemas_dir() / "router.schema.json").read_text(encoding="utf-8"))
        errors = sorted(Draft202012Validator(schema).iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
        if errors:
            lines = [f"{source}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]
            raise RouterConfigError("; ".join(lines))
    config = _build(data)
    problems = config_problems(config, source)
    if problems:
        raise RouterConfigError("; ".join(problems))
    return config


def config_to_dict(config: RouterConfig) -> dict[str, Any]:
    """The inverse of config_from_dict (how the worker processes get the supervisor's config)."""
    data = asdict(config)
    data["prefill"] = [{"name": u.name, "url": u.url} for u in config.prefill]
    data["decode"] = [{"name": u.name, "url": u.url} for u in config.decode]
    for key, members in (("prefill", config.prefill), ("decode", config.decode)):
        for item, u in zip(data[key], members, strict=True):
            if u.generation:
                item["generation"] = u.generation
    data["generations"] = [asdict(g) for g in config.generations]
    return data


def _build(data: dict[str, Any]) -> RouterConfig:
    return RouterConfig(
        prefill=_upstreams(data["prefill"], "prefill"),
        decode=_upstreams(data["decode"], "decode"),
        listen=data["listen"],
        port=int(data["port"]),
        model=data.get("model"),
        state=data.get("state", ROUTER_DEFAULTS["state"]),
        session_identity=data.get("session_identity", ROUTER_DEFAULTS["session_identity"]),
        session_ttl=float(data.get("session_ttl", ROUTER_DEFAULTS["session_ttl"])),
        expiry_margin=float(data.get("expiry_margin", ROUTER_DEFAULTS["expiry_margin"])),
        reuse=bool(data.get("reuse", ROUTER_DEFAULTS["reuse"])),
        api_keys_file=data.get("api_keys_file"),
        backend_api_key_env=data.get("backend_api_key_env", ROUTER_DEFAULTS["backend_api_key_env"]),
        timeouts=Timeouts(**data.get("timeouts", {})),
        health=HealthSettings(**data.get("health", {})),
        client_timeouts=ClientTimeouts(**data.get("client_timeouts", {})),
        paths=PathSettings(**data.get("paths", {})),
        topology=data.get("topology"),
        workers=data.get("workers", ROUTER_DEFAULTS["workers"]),
        max_body_bytes=int(data.get("max_body_bytes", ROUTER_DEFAULTS["max_body_bytes"])),
        max_json_depth=int(data.get("max_json_depth", ROUTER_DEFAULTS["max_json_depth"])),
        max_header_bytes=int(data.get("max_header_bytes", ROUTER_DEFAULTS["max_header_bytes"])),
        admin_key_file=data.get("admin_key_file"),
        tls_cert_file=data.get("tls_cert_file"),
        tls_key_file=data.get("tls_key_file"),
        state_password_file=data.get("state_password_file"),
        state_ca_file=data.get("state_ca_file"),
        local_redis_conf=data.get("local_redis_conf"),
        generations=tuple(
            GenerationSpec(g["id"], g.get("vllm"), g.get("model_root"), dict(g.get("fingerprint") or {}))
            for g in data.get("generations") or ()
        ),
        config_file=data.get("config_file"),
    )


def config_from_bytes(raw: bytes, path: Path) -> RouterConfig:
    """A config file's bytes → a validated RouterConfig that remembers its file (the router watches it)."""
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RouterConfigError(f"{path}: not UTF-8: {exc}") from None
    except yaml.YAMLError as exc:
        raise RouterConfigError(f"{path}: invalid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise RouterConfigError(f"{path}: expected a mapping")
    config = config_from_dict(data, str(path))
    return replace(config, config_file=str(path.absolute()))


def load_config(path: Path) -> RouterConfig:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RouterConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return config_from_bytes(raw, path)
