"""Run a Router under uvicorn (the `bpdkv router` command)."""

from __future__ import annotations

import logging

import uvicorn

from bpdkv.router.app import Router
from bpdkv.router.config import RouterConfig
from bpdkv.router.security import ReloadingTLS, uvicorn_tls


def serve(config: RouterConfig, log_level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(config)
    uv_config = uvicorn.Config(
        router.app,
        host=config.listen,
        port=config.port,
        log_level=log_level,
        access_log=False,  # request lines can carry session ids; metrics cover traffic
        timeout_graceful_shutdown=30,
        backlog=4096,
    )
    if config.tls_cert_file and config.tls_key_file:
        uvicorn_tls(uv_config, ReloadingTLS(config.tls_cert_file, config.tls_key_file))
    uvicorn.Server(uv_config).run()
