"""`bpdkv router`'s command-line flags → a RouterConfig: a config file (`bpdkv render` writes one) or --prefill/--decode
URLs, then each flag given overrides its field. Bad flags: one UsageError line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bpdkv.errors import UsageError
from bpdkv.router.config import HealthSettings, RouterConfig, UpstreamSpec, load_config


def config_from_flags(
    config_path: Path | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    listen: str | None,
    port: int | None,
    state: str | None,
    session_ttl: float | None,
    no_reuse: bool,
    health_interval: float | None,
    workers: str | None,
) -> RouterConfig:
    if config_path is not None:
        config = load_config(config_path)
    elif prefill and decode:
        config = RouterConfig(
            prefill=tuple(UpstreamSpec(f"prefill-{i}", u.rstrip("/")) for i, u in enumerate(prefill)),
            decode=tuple(UpstreamSpec(f"decode-{i}", u.rstrip("/")) for i, u in enumerate(decode)),
        )
    else:
        raise UsageError("give --config FILE, or at least one --prefill URL and one --decode URL")
    changes: dict[str, object] = {}
    if listen is not None:
        changes["listen"] = listen
    if port is not None:
        changes["port"] = port
    if state is not None:
        changes["state"] = state
    if session_ttl is not None:
        changes["session_ttl"] = session_ttl
    if no_reuse:
        changes["reuse"] = False
    if health_interval is not None:
        changes["health"] = dataclasses.replace(config.health or HealthSettings(), interval=health_interval)
    if workers is not None:
        if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
            raise UsageError(f"--workers {workers}: give a positive number or auto")
        changes["workers"] = workers if workers == "auto" else int(workers)
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]
