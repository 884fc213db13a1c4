"""Router configuration: the file `bpdkv render` writes (schemas/router.schema.json), or flags."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from bpdkv.errors import BpdkvError
from bpdkv.resources import schemas_dir


class RouterConfigError(BpdkvError):
    pass


@dataclass(frozen=True)
class UpstreamSpec:
    name: str
    url: str


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    prefill: float = 600.0
    decode_first_byte: float = 600.0
    decode_idle: float = 300.0


@dataclass(frozen=True)
class HealthSettings:
    interval: float = 5.0
    failures_to_eject: int = 3
    backoff_max: float = 60.0


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[UpstreamSpec, ...]
    decode: tuple[UpstreamSpec, ...]
    listen: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    state: str = "memory"
    session_identity: str = "auto"
    session_ttl: float = 470.0
    expiry_margin: float = 10.0
    reuse: bool = True
    api_keys_file: str | None = None
    backend_api_key_env: str | None = "BPDKV_BACKEND_API_KEY"
    timeouts: Timeouts = field(default_factory=Timeouts)
    health: HealthSettings = field(default_factory=HealthSettings)
    topology: str | None = None


def _upstreams(items: list[Any], role: str) -> tuple[UpstreamSpec, ...]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"url": item}
        out.append(UpstreamSpec(name=item.get("name") or f"{role}-{i}", url=item["url"].rstrip("/")))
    return tuple(out)


def config_from_dict(data: dict[str, Any], source: str = "router config") -> RouterConfig:
    schema = json.loads((schemas_dir() / "router.schema.json").read_text(encoding="utf-8"))
    errors = sorted(Draft202012Validator(schema).iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [f"{source}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]
        raise RouterConfigError("; ".join(lines))
    return RouterConfig(
        prefill=_upstreams(data["prefill"], "prefill"),
        decode=_upstreams(data["decode"], "decode"),
        listen=data["listen"],
        port=int(data["port"]),
        model=data.get("model"),
        state=data.get("state", "memory"),
        session_identity=data.get("session_identity", "auto"),
        session_ttl=float(data.get("session_ttl", 470)),
        expiry_margin=float(data.get("expiry_margin", 10)),
        reuse=bool(data.get("reuse", True)),
        api_keys_file=data.get("api_keys_file"),
        backend_api_key_env=data.get("backend_api_key_env", "BPDKV_BACKEND_API_KEY"),
        timeouts=Timeouts(**data.get("timeouts", {})),
        health=HealthSettings(**data.get("health", {})),
        topology=data.get("topology"),
    )


def load_config(path: Path) -> RouterConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RouterConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise RouterConfigError(f"{path}: invalid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise RouterConfigError(f"{path}: expected a mapping")
    return config_from_dict(data, str(path))


def load_api_keys(path: str | None) -> set[str]:
    if not path:
        return set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RouterConfigError(f"{path}: cannot read API keys file: {exc.strerror or exc}") from None
    return {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
